"""Train a tiny random Llama whose 2-D Linear weights are 4-bit quantized; print JSON lines.

Works with transformers 4.57.x and 5.x. Every ``nn.Linear`` inside the decoder layers gets its
``weight`` replaced by bitsandbytes' ``replace_parameter_4bit`` (a parametrization, not a
``Linear4bit``), the embeddings and RMS norms stay trainable, and the model is trained for a few
steps under transformers' own gradient checkpointing:

    python tests/scenarios/tiny_llama_linear.py --steps 3 --layers 2 \
        [--checkpointing non-reentrant|reentrant|default|off] [--import-fix]

``default`` calls ``gradient_checkpointing_enable()`` without kwargs, i.e. whatever the installed
transformers defaults to (4.57: ``use_reentrant=True``). It imports ``bnb_gc_fix`` only with
``--import-fix``; with the start-up hook installed the fix goes into bitsandbytes' hooks anyway when
``bitsandbytes.nn.parametrize`` is imported. One JSON line per step (``counter``, ``cache_bytes``), then
``{"summary": ...}``.
"""

from __future__ import annotations

import argparse
from typing import Any

import report


def build(layers: int, hidden: int = 64, device: str = "cpu", dtype: str = "float32") -> Any:
    import torch
    from bitsandbytes.nn import parametrize as bnb_parametrize
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype))
    quantized = 0
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                bnb_parametrize.replace_parameter_4bit(module, "weight", quant_type="nf4")
                quantized += 1
    for name, parameter in model.named_parameters():
        trainable = "norm" in name or "embed_tokens" in name
        parameter.requires_grad_(trainable)
    return model, quantized


def effective_use_reentrant(model: Any) -> Any:
    """The ``use_reentrant`` the decoder layers' checkpoint function got ("off" without checkpointing)."""
    for module in model.modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if function is not None and getattr(module, "gradient_checkpointing", False):
            return getattr(function, "keywords", {}).get("use_reentrant", "torch default")
    return "off"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--checkpointing", choices=["non-reentrant", "reentrant", "default", "off"], default="non-reentrant"
    )
    parser.add_argument("--import-fix", action="store_true")
    args = parser.parse_args()

    if args.import_fix:
        import bnb_gc_fix  # noqa: F401

    import torch
    import transformers

    model, quantized = build(args.layers)
    if args.checkpointing == "non-reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif args.checkpointing == "reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif args.checkpointing == "default":
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    summary: dict[str, Any] = {
        "error": None,
        "transformers": transformers.__version__,
        "checkpointing": args.checkpointing,
        "use_reentrant": effective_use_reentrant(model),
        "quantized_linears": quantized,
    }
    for step in range(args.steps):
        record: dict[str, Any] = {"step": step}
        try:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        except RuntimeError as error:
            summary["error"] = str(error).splitlines()[0]
            report.emit(record | {"error": summary["error"]})
            break
        record["loss"] = float(loss.item())
        report.emit(record | report.cache_state())
    report.finish(summary)


if __name__ == "__main__":
    main()
