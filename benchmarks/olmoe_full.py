"""The leak at the bug report's real width: one decoder layer of OLMoE-1B-7B's shapes, random weights,
trained with gradient checkpointing, unfixed against this package, each in a fresh worker. What the cache
holds after every step, the chunked quantization that builds the layer on a small machine, and the
16-layer figure as arithmetic: benchmarks/README.md, "Full size".

    python benchmarks/olmoe_full.py --device cuda  # on a GPU: results/olmoe-full-cuda.md
    python benchmarks/olmoe_full.py                # full width on the CPU: results/olmoe-full-cpu.md
    python benchmarks/olmoe_full.py --smoke        # reduced width, same code path (results/tmp/)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _harness as harness

#: allenai/OLMoE-1B-7B-0924 (transformers' OlmoeConfig defaults are that model, but for the
#: expert intermediate size, which is 1024 there). The benchmark builds one of its 16 decoder layers.
OLMOE_1B_7B: dict[str, Any] = {
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "norm_topk_prob": False,
    "tie_word_embeddings": False,
    "pad_token_id": 1,
    "bos_token_id": None,
    "eos_token_id": 50279,
}
#: A reduced width of the same architecture, for smoke runs of the same code path.
SMOKE: dict[str, Any] = {
    **OLMOE_1B_7B,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_experts": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts_per_tok": 2,
    "pad_token_id": None,
    "eos_token_id": None,
}
BLOCKSIZE = 64
QUANT_TYPE = "nf4"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("gate_up_proj", "down_proj")
INIT_STD = 0.02  # the config's initializer_range
SEED = 0
CHUNK = 4 * 2**20  # values per quantize_4bit call (whole blocks): about 0.6 GB of peak memory a call
SMOKE_CHUNK = 4096  # small enough that every smoke tensor is quantized in several chunks
COLUMNS = (harness.UNFIXED, harness.PACKAGE)
SEQ = 300


# --------------------------------------------------------------------------- chunked quantization


def quantize_4bit_chunked(
    original: Callable[..., Any],
    A: Any,  # noqa: N803  (bitsandbytes' own argument name)
    blocksize: int = BLOCKSIZE,
    quant_type: str = QUANT_TYPE,
    quant_storage: Any = None,
    chunk: int = CHUNK,
) -> tuple[Any, Any]:
    """bitsandbytes' ``quantize_4bit(A)`` (``original``) on chunks of ``chunk`` values (whole blocks) of the
    flattened tensor; the packed codes and absmax concatenated into one ``QuantState``, as one call makes
    it. No double quantization (the report's setting)."""
    import bitsandbytes.functional as F
    import torch

    flat = A.reshape(-1)
    step = max(blocksize, chunk // blocksize * blocksize)
    codes, absmax = [], []
    for start in range(0, flat.numel(), step):
        part = flat[start : start + step]
        packed, state = original(
            part, blocksize=blocksize, quant_type=quant_type, quant_storage=quant_storage or torch.uint8
        )
        codes.append(packed)
        absmax.append(state.absmax)
    state = F.QuantState(
        absmax=torch.cat(absmax),
        shape=A.shape,
        dtype=A.dtype,
        blocksize=blocksize,
        code=F.get_4bit_type(quant_type, device=A.device),
        quant_type=quant_type,
    )
    return torch.cat(codes, dim=0), state


@contextlib.contextmanager
def chunked_quantize_4bit(chunk: int, shapes: list[list[int]]) -> Iterator[None]:
    """Inside the block, ``bitsandbytes.functional.quantize_4bit`` is ``quantize_4bit_chunked``; the shape
    of every tensor it quantizes is appended to ``shapes``. What calls it (``replace_parameter_4bit``,
    ``Params4bit._quantize``) runs unchanged around it."""
    import bitsandbytes.functional as F

    original = F.quantize_4bit

    def quantize_4bit(
        A: Any,  # noqa: N803  (bitsandbytes' signature)
        absmax: Any = None,
        out: Any = None,
        blocksize: int | None = None,
        compress_statistics: bool = False,
        quant_type: str = "fp4",
        quant_storage: Any = None,
    ) -> tuple[Any, Any]:
        if absmax is not None or out is not None or compress_statistics:
            raise ValueError("the benchmark quantizes without absmax/out and without double quantization")
        shapes.append(list(A.shape))
        return quantize_4bit_chunked(original, A, blocksize or BLOCKSIZE, quant_type, quant_storage, chunk)

    F.quantize_4bit = quantize_4bit
    try:
        yield
    finally:
        F.quantize_4bit = original


def check_chunking(numel: int = 6 * 2**20, chunk: int = 2**20 + 3 * 64) -> dict[str, Any]:
    """One random bfloat16 tensor quantized in one call and in chunks (``chunk`` neither a divisor of it
    nor a power of two); every part compared. Raises if anything differs."""
    import bitsandbytes.functional as F
    import torch

    generator = torch.Generator().manual_seed(123)
    tensor = torch.empty(numel // 1024, 1024, dtype=torch.bfloat16).normal_(0, INIT_STD, generator=generator)
    whole, whole_state = F.quantize_4bit(tensor, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE)
    parts, parts_state = quantize_4bit_chunked(F.quantize_4bit, tensor, chunk=chunk)

    def described(state: Any) -> tuple[Any, ...]:
        return (state.shape, state.dtype, state.blocksize, state.quant_type)

    dequantized = (F.dequantize_4bit(whole, whole_state), F.dequantize_4bit(parts, parts_state))
    result = {
        "parameters": tensor.numel(),
        "chunk_parameters": chunk // BLOCKSIZE * BLOCKSIZE,
        "packed_equal": bool(whole.shape == parts.shape and torch.equal(whole, parts)),
        "absmax_equal": bool(torch.equal(whole_state.absmax, parts_state.absmax)),
        "state_equal": described(whole_state) == described(parts_state)
        and bool(torch.equal(whole_state.code, parts_state.code)),
        "dequantized_equal": bool(torch.equal(*dequantized)),
    }
    if not all(result[key] for key in ("packed_equal", "absmax_equal", "state_equal", "dequantized_equal")):
        raise SystemExit(f"chunked quantize_4bit differs from one call: {result}")
    return result


# --------------------------------------------------------------------------- the model


def expert_parameters_per_layer(config: Any) -> int:
    """Parameters of one layer's two fused expert stacks (402,653,184 for OLMoE-1B-7B)."""
    return int(3 * config.num_experts * config.intermediate_size * config.hidden_size)


def _random(shape: tuple[int, ...], seed: int, device: str) -> Any:
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    tensor = torch.empty(shape, dtype=torch.bfloat16, device=device)
    if len(shape) == 3:  # an expert stack: one expert at a time keeps the float temporaries small
        for index in range(shape[0]):
            tensor[index].normal_(0, INIT_STD, generator=generator)
    else:
        tensor.normal_(0, INIT_STD, generator=generator)
    return tensor


def _seed(name: str) -> int:
    """The seed of a weight of the layer (the same as the first layer's in the earlier 1-16 layer runs)."""
    return SEED + 1000 + sum(ord(c) * (i + 1) for i, c in enumerate(name))


def _parameter(tensor: Any) -> Any:
    import torch

    return torch.nn.Parameter(tensor, requires_grad=False)


def _ones(shape: Any, device: str) -> Any:
    import torch

    return _parameter(torch.ones(shape, dtype=torch.bfloat16, device=device))


def _linear4bit(linear: Any, weight: Any, device: str) -> Any:
    """As transformers' 4-bit loading makes it: a ``Linear4bit`` whose ``Params4bit`` holds the bfloat16
    weight and quantizes it on ``.to(device)``."""
    import bitsandbytes as bnb
    import torch

    replacement = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=False,
        compute_dtype=torch.bfloat16,
        compress_statistics=False,
        quant_type=QUANT_TYPE,
        quant_storage=torch.uint8,
        device="meta",
    )
    replacement._parameters["weight"] = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        blocksize=BLOCKSIZE,
        compress_statistics=False,
        quant_type=QUANT_TYPE,
        quant_storage=torch.uint8,
        module=replacement,
    ).to(device)
    return replacement


def build_layer(layer: Any, device: str) -> None:
    """Materialise a meta-device decoder layer on ``device``, quantized as the report does: the attention
    projections ``Linear4bit``, both fused expert stacks by ``replace_parameter_4bit``, the router gate
    bfloat16."""
    from bitsandbytes.nn import parametrize as bnb_parametrize

    attention = layer.self_attn
    for norm in (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm):
        norm.weight = _ones(norm.weight.shape, device)
    layer.mlp.gate.weight = _parameter(_random(tuple(layer.mlp.gate.weight.shape), _seed("gate"), device))
    for name in LINEARS:
        linear = getattr(attention, name)
        weight = _random((linear.out_features, linear.in_features), _seed(name), device)
        setattr(attention, name, _linear4bit(linear, weight, device))
    experts = layer.mlp.experts
    for name in EXPERTS:
        shape = tuple(getattr(experts, name).shape)
        setattr(experts, name, _parameter(_random(shape, _seed(name), device)))
        bnb_parametrize.replace_parameter_4bit(experts, name, quant_type=QUANT_TYPE)


def build_model(device: str, smoke: bool, chunk: int | None, shapes: list[list[int]]) -> Any:
    """OLMoE-1B-7B's shapes (or the smoke width) with one decoder layer, built on the meta device and
    materialised weight by weight (quantized in chunks of ``chunk`` values unless None); only the router
    gate (``.mlp.gate.``) trainable."""
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(**{**(SMOKE if smoke else OLMOE_1B_7B), "num_hidden_layers": 1})
    config.use_cache = False
    with torch.device("meta"):
        model = OlmoeForCausalLM(config)
    inner = model.model
    inner.embed_tokens.weight = _parameter(_random(tuple(inner.embed_tokens.weight.shape), SEED + 1, device))
    model.lm_head.weight = _parameter(_random(tuple(model.lm_head.weight.shape), SEED + 2, device))
    inner.norm.weight = _ones(inner.norm.weight.shape, device)
    inner.rotary_emb = type(inner.rotary_emb)(config=config, device=device)
    with contextlib.nullcontext() if chunk is None else chunked_quantize_4bit(chunk, shapes):
        build_layer(inner.layers[0], device)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    leftover = [name for name, tensor in tensors if tensor.is_meta]
    if leftover:
        raise RuntimeError(f"parameters left on the meta device: {leftover[:5]}")
    model.config.dtype = torch.bfloat16
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".mlp.gate." in name)
    return model


# --------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    """Build the layer, say it is ready, run the steps: one message each."""
    column = args.worker
    harness.start(column, threads=None)
    cuda = harness.is_cuda(args.device)
    chunk: int | None = SMOKE_CHUNK if args.smoke else CHUNK
    if cuda:
        chunk = None  # on CUDA, bitsandbytes' own quantize_4bit, one call a tensor
    shapes: list[list[int]] = []
    model = build_model(args.device, args.smoke, chunk, shapes)
    model.gradient_checkpointing_enable()
    optimizer, ids = harness.trainer(model, 1e-4, 1, args.seq, args.device)
    ready = {
        "fix": harness.fix_state(column),
        "quantized_in_chunks": shapes,
        "expert_parameters_per_layer": expert_parameters_per_layer(model.config),
    }
    harness.emit(ready)
    for _ in range(args.steps):
        harness.emit(harness.train_step(model, ids, optimizer, cuda))


# --------------------------------------------------------------------------- the driver


def run_column(column: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh worker: what it said when ready and after every step."""
    options = {
        "worker": column,
        "steps": args.steps,
        "seq": args.seq,
        "device": args.device,
        "smoke": args.smoke,
    }
    command = harness.worker_command(Path(__file__).resolve(), options)
    watched = harness.Worker(column, command, harness.config_env(column))
    ready = watched.receive()
    steps = [watched.receive() for _ in range(args.steps)]
    watched.close()
    return {"column": column, **ready, "steps": steps}


def anchor(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's anchor: unfixed, the counter climbs by 2 a step (2, 4, ...) and the cache holds the
    layer's expert stacks in bfloat16 after every step (805,306,368 bytes at full width); fixed, 0 and 0."""
    expected_bytes = runs[0]["expert_parameters_per_layer"] * 2
    reproduced = True
    for run in runs:
        counters = [record["counter"] for record in run["steps"]]
        held = [record["cache_bytes"] for record in run["steps"]]
        if run["column"] == harness.UNFIXED:
            expected_counters = [2 * (step + 1) for step in range(len(counters))]
            expected_held = [expected_bytes] * len(held)
        else:
            expected_counters = expected_held = [0] * len(counters)
        reproduced = reproduced and counters == expected_counters and held == expected_held
    return {"expected_bytes": expected_bytes, "reproduced": reproduced}


def losses_identical(runs: list[dict[str, Any]]) -> bool:
    """Whether both columns saw the same loss at every step (they build the same model)."""
    losses = [[record["loss"] for record in run["steps"]] for run in runs]
    return all(other == losses[0] for other in losses[1:])


# --------------------------------------------------------------------------- the report


def step_rows(runs: list[dict[str, Any]], cuda: bool) -> tuple[list[str], list[list[str]]]:
    """The per-step table: each column's counter and cache bytes (and peak allocated on CUDA)."""
    header = ["step"]
    for run in runs:
        header += [f"{run['column']}: counter", f"{run['column']}: bytes held by the cache"]
        if cuda:
            header.append(f"{run['column']}: peak allocated")
    rows = []
    for step in range(len(runs[0]["steps"])):
        row = [str(step + 1)]
        for run in runs:
            record = run["steps"][step]
            row += [str(record["counter"]), f"{record['cache_bytes']:,}"]
            if cuda:
                row.append(f"{record['max_allocated_bytes']:,}")
        rows.append(row)
    return header, rows


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    runs = result["runs"]
    header, rows = step_rows(runs, harness.is_cuda(settings["device"]))
    per_layer = runs[0]["expert_parameters_per_layer"]
    layers = OLMOE_1B_7B["num_hidden_layers"]
    width = "reduced width, a smoke run" if settings["smoke"] else "allenai/OLMoE-1B-7B-0924's shapes"
    training = f"batch 1x{settings['seq']}, gradient checkpointing, router gate trained"
    steps = len(runs[0]["steps"])
    lines = [
        f"One decoder layer of OLMoE-1B-7B ({width}), random weights, bfloat16, nf4; {training}, {steps} "
        f"steps on {settings['device']}.",
        "",
        *harness.table(header, rows),
        "",
        f"Expected: unfixed, the layer's {per_layer:,} expert parameters x 2 bytes = "
        f"{result['anchor']['expected_bytes']:,} bytes after every step, the counter climbing by 2 a step; "
        f"bnb-gc-fix 0. Reproduced: **{result['anchor']['reproduced']}**. Losses identical in both columns "
        f"at every step: **{result['losses_identical']}**.",
        "",
        f"All {layers} layers (arithmetic, not measured): {layers} x {per_layer:,} x 2 bytes = "
        f"{layers * per_layer * 2:,} bytes.",
        "",
        harness.machine_line(result["machine"]),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--smoke", action="store_true", help="reduced width, same code path; results/tmp/")
    parser.add_argument("--output", type=Path, help="the raw JSON (its .md beside it)")
    parser.add_argument("--worker", choices=COLUMNS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    cuda = harness.is_cuda(args.device)
    result: dict[str, Any] = {
        "benchmark": "olmoe-full",
        "machine": harness.machine(),
        "settings": {"device": args.device, "smoke": args.smoke, "seq": args.seq},
    }
    if not cuda:  # the chunks the build quantizes in, against one call (CUDA quantizes in one call)
        result["chunking_check"] = check_chunking(2**16, 5000) if args.smoke else check_chunking()
    runs = []
    for column in COLUMNS:
        print(f"{column}: running", file=sys.stderr, flush=True)
        runs.append(run_column(column, args))
    result["runs"] = runs
    result["anchor"] = anchor(runs)
    result["losses_identical"] = losses_identical(runs)
    name = f"olmoe-full-{'cuda' if cuda else 'cpu'}{'-smoke' if args.smoke else ''}"
    harness.write_results(name, result, markdown(result), args.smoke, args.output)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=FutureWarning)  # bitsandbytes' CPU backend, every quantization
    main()
