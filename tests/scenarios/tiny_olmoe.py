"""Train a tiny random OLMoE with 4-bit quantized fused experts; print one JSON line per step.

Run as a script in a fresh interpreter by the tests (and usable by hand):

    python tests/scenarios/tiny_olmoe.py --steps 5 [--no-checkpointing] [--import-fix]
        [--weight-norm] [--layers 3]

It imports ``bnb_gc_fix`` only with ``--import-fix``, so the start-up hook and the fix's other ways in
can be tested with an unchanged script. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import warnings

import report


def build(  # type: ignore[no-untyped-def]
    layers: int = 3,
    experts: int = 8,
    hidden: int = 64,
    weight_norm: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
):
    """A random tiny OLMoE whose fused experts are quantized to 4 bits by bitsandbytes.

    That is transformers 5; on 4.x (no fused experts) it is the tiny Llama of
    ``tiny_llama_linear.py`` instead, whose every Linear weight is quantized.

    On transformers 5 only the router gates (``.mlp.gate.``) are trainable, as in a router-only
    fine-tune. The model is moved to ``device`` before quantizing, so the quantization state lives
    there. Returns ``(model, extra)``, ``extra`` being the weight_norm Linear when asked for. The
    benchmarks build their model here too.
    """
    import torch
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        # transformers 4.x keeps one Linear per projection and expert, and the recompute of its
        # OLMoE layer stops outside them: no leak to show. There the bug's shape is a dense model
        # whose quantized Linears end each layer (tiny_llama_linear.py), trained the same way.
        import tiny_llama_linear

        model, _ = tiny_llama_linear.build(layers, hidden, device=device, dtype=dtype)
    else:
        model = _olmoe(layers, experts, hidden, device, dtype)
    extra = None
    if weight_norm:
        # A trainable weight_norm Linear beside the quantized experts, used on every step.
        extra = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(hidden, hidden))
        model.model.layers[0].extra = extra
        inner = model.model.layers[0].mlp

        def hook(module, args, output):  # type: ignore[no-untyped-def]
            return output + extra(output)

        inner.register_forward_hook(hook)
    return model, extra


def _olmoe(layers: int, experts: int, hidden: int, device: str, dtype: str):  # type: ignore[no-untyped-def]
    """transformers 5: the experts are fused 3-D weights, quantized as such; only the router trains."""
    import torch
    from bitsandbytes.nn import parametrize as bnb_parametrize
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    config = OlmoeConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    model = OlmoeForCausalLM(config).to(device=device, dtype=getattr(torch, dtype))
    for layer in model.model.layers:
        bnb_parametrize.replace_parameter_4bit(layer.mlp.experts, "gate_up_proj", quant_type="nf4")
        bnb_parametrize.replace_parameter_4bit(layer.mlp.experts, "down_proj", quant_type="nf4")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name, parameter in model.named_parameters():
        if ".mlp.gate." in name:
            parameter.requires_grad_(True)
    return model


# Non-reentrant checkpointing, the mode that leaks: transformers 5's default, said explicitly
# because transformers 4.x defaults to reentrant checkpointing (which never leaks).
CHECKPOINTING = {"use_reentrant": False}


def enable_checkpointing(model) -> None:  # type: ignore[no-untyped-def]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--import-fix", action="store_true")
    parser.add_argument("--weight-norm", action="store_true")
    args = parser.parse_args()

    if args.import_fix:
        import bnb_gc_fix  # noqa: F401 (importing it asks for the fix)

    import torch

    model, extra = build(layers=args.layers, weight_norm=args.weight_norm)
    if not args.no_checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = False
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=generator)
    previous = None
    summary: dict[str, object] = {"error": None, "package_warnings": 0}
    for step in range(args.steps):
        record: dict[str, object] = {"step": step}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            ours = [w for w in caught if type(w.message).__module__.startswith("bnb_gc_fix")]
            summary["package_warnings"] = int(summary["package_warnings"]) + len(ours)  # type: ignore[call-overload]
            record["loss"] = float(loss.item())
        except RuntimeError as error:
            summary["error"] = str(error).splitlines()[0]
            report.emit(record | {"error": summary["error"]})
            break
        record.update(report.cache_state())
        if extra is not None:
            weight = extra.weight.detach().clone()
            record["weight_norm_changed"] = previous is None or not torch.equal(weight, previous)
            previous = weight
        report.emit(record)
    report.finish(summary)


if __name__ == "__main__":
    main()
