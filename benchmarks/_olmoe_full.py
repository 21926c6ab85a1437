"""OLMoE-1B-7B at its real shapes, random weights, built one layer at a time and quantized to 4 bits.

The model of ``benchmarks/olmoe_full.py`` (and of ``gpu.py --full``): allenai/OLMoE-1B-7B-0924's
configuration (hidden 2048, 16 layers, 16 heads, 64 experts, top-8, expert intermediate size 1024,
vocab 50304) as a transformers 5 ``OlmoeForCausalLM``, whose experts are fused 3-D parameters.
Nothing is downloaded. The report's recipe, on random weights:

* the attention projections are ``bitsandbytes.nn.Linear4bit`` (nf4, bfloat16 compute, no double
  quantization), made the way a 4-bit ``from_pretrained`` makes them: a ``Params4bit`` holding the
  bfloat16 weight, quantized by its ``.to(device)``; the router gates and ``lm_head`` stay bfloat16
  (the report's ``llm_int8_skip_modules=["gate", "lm_head"]``);
* both fused expert stacks of every layer go through
  ``bitsandbytes.nn.parametrize.replace_parameter_4bit(experts, name, quant_type="nf4")``: its
  parametrization and its hook registration (the code the leak lives in, and that the fixes patch)
  run unchanged.

The model is built on the meta device and materialised one layer at a time, so the full bfloat16
model (13.8 GB) never exists: at most one layer's expert stack (805 MB) is in memory unquantized.

**Quantization on the CPU.** bitsandbytes 0.49.2's CPU ``quantize_4bit`` needs about 136 bytes
of memory per parameter in one call, so one call on a [64, 2048, 2048] stack cannot finish in
24 GiB. While a layer is built, ``bitsandbytes.functional.quantize_4bit`` is swapped (for that one
call, inside ``replace_parameter_4bit`` / ``Params4bit._quantize``) for :func:`quantize_4bit_chunked`:
the same function on chunks of whole 64-value blocks, concatenated. Blockwise quantization treats
every block on its own, so the packed codes and absmax are bit-identical to one call
(:func:`check_chunking` proves it on a real tensor at every cache build).

**Reuse.** Quantizing one layer on this machine takes over a minute, so the result, the packed
data and absmax of every quantized tensor of a layer, is saved in a cache folder outside the
work tree (``~/.cache/bnb-gc-fix-bench/``, keyed by the shapes, seed and bitsandbytes/torch
versions). A later build of the same layer passes the saved tensors back from the swapped
``quantize_4bit`` instead of recomputing them (checking shape and dtype); everything around it,
``replace_parameter_4bit``'s parameter swap, ``register_parametrization`` and the forward hooks,
or ``Params4bit``'s quantization bookkeeping, runs as in the first build. With a cached layer the
unquantized weight is not generated at all (the expert parameter handed to
``replace_parameter_4bit`` is a bfloat16 tensor on the meta device).

On CUDA no cache is used: the weights are generated on the GPU and bitsandbytes' own
``quantize_4bit`` runs unswapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: allenai/OLMoE-1B-7B-0924 (transformers' OlmoeConfig defaults are that model, but for the
#: expert intermediate size, which is 1024 there).
OLMOE_1B_7B = {
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
SMOKE = {
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
#: Parameters per quantize_4bit call when chunking (a multiple of the block size): 4 Mi values,
#: about 0.6 GB of peak memory per call.
CHUNK = 4 * 2**20
#: The smoke runs' chunk: small enough that every smoke tensor is quantized in several chunks.
SMOKE_CHUNK = 4096
DEFAULT_CACHE = Path(os.environ.get("BNB_GC_FIX_BENCH_CACHE", Path.home() / ".cache" / "bnb-gc-fix-bench"))


def olmoe_config(layers: int, shape: dict[str, Any] | None = None) -> Any:
    from transformers import OlmoeConfig

    values = dict(OLMOE_1B_7B if shape is None else shape)
    values["num_hidden_layers"] = layers
    config = OlmoeConfig(**values)
    config.use_cache = False
    return config


def expert_parameters_per_layer(config: Any) -> int:
    """Parameters of one layer's two fused expert stacks (402,653,184 for OLMoE-1B-7B)."""
    return int(3 * config.num_experts * config.intermediate_size * config.hidden_size)


# --------------------------------------------------------------------------- chunked quantization


def quantize_4bit_chunked(
    original: Callable[..., Any],
    A: Any,  # noqa: N803  (bitsandbytes' own argument name)
    blocksize: int | None = None,
    quant_type: str = QUANT_TYPE,
    quant_storage: Any = None,
    chunk: int = CHUNK,
) -> tuple[Any, Any]:
    """``bitsandbytes.functional.quantize_4bit(A)`` computed on chunks of whole blocks.

    ``original`` is bitsandbytes' own ``quantize_4bit``; it quantizes each chunk of the flattened
    tensor (``chunk`` values, rounded down to whole blocks), and the packed codes and absmax are
    concatenated into one ``QuantState`` for ``A``'s shape and dtype, as one call would make it.
    No double quantization (``compress_statistics=False``, the report's setting).
    """
    import bitsandbytes.functional as F
    import torch

    blocksize = blocksize or 64
    storage = quant_storage or torch.uint8
    flat = A.reshape(-1)
    step = max(blocksize, chunk // blocksize * blocksize)
    codes, absmax = [], []
    for start in range(0, flat.numel(), step):
        packed, state = original(
            flat[start : start + step], blocksize=blocksize, quant_type=quant_type, quant_storage=storage
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


def check_chunking(numel: int = 6 * 2**20, chunk: int = 2**20 + 3 * 64) -> dict[str, Any]:
    """Quantize one random bfloat16 tensor in one call and in chunks; compare everything.

    ``chunk`` is deliberately not a divisor of the tensor (the last chunk is short) and not a power
    of two. Returns the comparison; raises if anything differs.
    """
    import bitsandbytes.functional as F
    import torch

    generator = torch.Generator().manual_seed(123)
    tensor = torch.empty(numel // 1024, 1024, dtype=torch.bfloat16).normal_(0, INIT_STD, generator=generator)
    started = time.perf_counter()
    whole, whole_state = F.quantize_4bit(tensor, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE)
    one_call_s = time.perf_counter() - started
    started = time.perf_counter()
    parts, parts_state = quantize_4bit_chunked(
        F.quantize_4bit, tensor, blocksize=BLOCKSIZE, quant_type=QUANT_TYPE, chunk=chunk
    )
    chunked_s = time.perf_counter() - started
    result = {
        "parameters": tensor.numel(),
        "chunk_parameters": chunk // BLOCKSIZE * BLOCKSIZE,
        "packed_shape": list(whole.shape),
        "packed_equal": bool(whole.shape == parts.shape and torch.equal(whole, parts)),
        "absmax_equal": bool(torch.equal(whole_state.absmax, parts_state.absmax)),
        "state_equal": (whole_state.shape, whole_state.dtype, whole_state.blocksize, whole_state.quant_type)
        == (parts_state.shape, parts_state.dtype, parts_state.blocksize, parts_state.quant_type)
        and bool(torch.equal(whole_state.code, parts_state.code)),
        "dequantized_equal": bool(
            torch.equal(F.dequantize_4bit(whole, whole_state), F.dequantize_4bit(parts, parts_state))
        ),
        "one_call_s": one_call_s,
        "chunked_s": chunked_s,
    }
    if not all(result[key] for key in ("packed_equal", "absmax_equal", "state_equal", "dequantized_equal")):
        raise SystemExit(f"chunked quantize_4bit differs from one call: {result}")
    return result


# --------------------------------------------------------------------------- the cache


class LayerCache:
    """The quantized tensors of each layer, one ``torch.save`` file per layer."""

    def __init__(self, root: Path, config: Any) -> None:
        import bitsandbytes
        import torch

        shape = {key: getattr(config, key) for key in OLMOE_1B_7B if key != "num_hidden_layers"}
        key = repr(
            (
                sorted(shape.items()),
                SEED,
                INIT_STD,
                BLOCKSIZE,
                QUANT_TYPE,
                bitsandbytes.__version__,
                torch.__version__.split("+")[0],
            )
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        self.folder = root / f"olmoe-h{config.hidden_size}-e{config.num_experts}-nf4-{digest}"
        self.key = key

    def path(self, layer: int) -> Path:
        return self.folder / f"layer{layer:02d}.pt"

    def load(self, layer: int) -> dict[str, dict[str, Any]] | None:
        import torch

        path = self.path(layer)
        if not path.exists():
            return None
        loaded: dict[str, dict[str, Any]] = torch.load(path, weights_only=True)
        return loaded

    def save(self, layer: int, tensors: dict[str, dict[str, Any]]) -> None:
        import torch

        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "key.txt").write_text(self.key + "\n")
        temporary = self.path(layer).with_suffix(".tmp")
        torch.save(tensors, temporary)
        temporary.replace(self.path(layer))


@contextlib.contextmanager
def quantize_through(provide: Callable[..., tuple[Any, Any]]) -> Iterator[None]:
    """Swap ``bitsandbytes.functional.quantize_4bit`` for ``provide`` inside the block only."""
    import bitsandbytes.functional as F

    original = F.quantize_4bit
    F.quantize_4bit = provide
    try:
        yield
    finally:
        F.quantize_4bit = original


class Quantizer:
    """What the swapped ``quantize_4bit`` returns for one layer: cached tensors, or chunked codes."""

    def __init__(self, cached: dict[str, dict[str, Any]] | None, chunk: int) -> None:
        import bitsandbytes.functional as F

        self.original = F.quantize_4bit
        self.cached = cached
        self.made: dict[str, dict[str, Any]] = {}
        self.chunk = chunk

    def provider(self, name: str) -> Callable[..., tuple[Any, Any]]:
        def quantize_4bit(
            A: Any,  # noqa: N803  (bitsandbytes' signature)
            absmax: Any = None,
            out: Any = None,
            blocksize: int | None = None,
            compress_statistics: bool = False,
            quant_type: str = "fp4",
            quant_storage: Any = None,
        ) -> tuple[Any, Any]:
            import bitsandbytes.functional as F
            import torch

            if absmax is not None or out is not None or compress_statistics:
                raise ValueError("the benchmark quantizes without absmax/out and without double quantization")
            blocksize = blocksize or 64
            if self.cached is not None:
                saved = self.cached[name]
                if tuple(saved["shape"]) != tuple(A.shape) or saved["quant_type"] != quant_type:
                    raise ValueError(f"cached {name} does not match: {saved['shape']} vs {tuple(A.shape)}")
                state = F.QuantState(
                    absmax=saved["absmax"],
                    shape=A.shape,
                    dtype=A.dtype,
                    blocksize=blocksize,
                    code=F.get_4bit_type(quant_type, device="cpu"),
                    quant_type=quant_type,
                )
                return saved["packed"], state
            packed, state = quantize_4bit_chunked(
                self.original, A, blocksize, quant_type, quant_storage or torch.uint8, self.chunk
            )
            self.made[name] = {
                "packed": packed,
                "absmax": state.absmax,
                "shape": list(A.shape),
                "quant_type": quant_type,
            }
            return packed, state

        return quantize_4bit


# --------------------------------------------------------------------------- the model


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


def _seed(layer: int, name: str) -> int:
    return SEED + 1000 * (layer + 1) + sum(ord(c) * (i + 1) for i, c in enumerate(name))


def _parameter(tensor: Any, trainable: bool = False) -> Any:
    import torch

    return torch.nn.Parameter(tensor, requires_grad=trainable)


def build_layer(
    model: Any, index: int, device: str, cache: LayerCache | None, chunk: int = CHUNK
) -> dict[str, Any]:
    """Materialise decoder layer ``index`` of a meta-device model on ``device``, quantized."""
    import bitsandbytes as bnb
    import torch
    from bitsandbytes.nn import parametrize as bnb_parametrize

    started = time.perf_counter()
    layer = model.model.layers[index]
    for norm in (
        layer.input_layernorm,
        layer.post_attention_layernorm,
        layer.self_attn.q_norm,
        layer.self_attn.k_norm,
    ):
        norm.weight = _parameter(torch.ones(norm.weight.shape, dtype=torch.bfloat16, device=device))
    gate = layer.mlp.gate
    gate.weight = _parameter(_random(tuple(gate.weight.shape), _seed(index, "gate"), device))
    cached = cache.load(index) if cache is not None else None
    quantizer = Quantizer(cached, chunk) if cache is not None else None

    def quantizing(name: str) -> contextlib.AbstractContextManager[None]:
        if quantizer is None:
            return contextlib.nullcontext()
        return quantize_through(quantizer.provider(name))

    for name in LINEARS:
        linear = getattr(layer.self_attn, name)
        shape = (linear.out_features, linear.in_features)
        # As transformers' bitsandbytes 4-bit loading does: a Linear4bit whose Params4bit holds
        # the bfloat16 weight and quantizes it on .to(device).
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
        weight = (
            torch.empty(shape, dtype=torch.bfloat16, device=device)
            if cached is not None
            else _random(shape, _seed(index, name), device)
        )
        with quantizing(name):
            replacement._parameters["weight"] = bnb.nn.Params4bit(
                weight,
                requires_grad=False,
                blocksize=BLOCKSIZE,
                compress_statistics=False,
                quant_type=QUANT_TYPE,
                quant_storage=torch.uint8,
                module=replacement,
            ).to(device)
        del weight
        setattr(layer.self_attn, name, replacement)
    experts = layer.mlp.experts
    for name in EXPERTS:
        shape = tuple(getattr(experts, name).shape)
        if cached is not None:
            weight = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        else:
            weight = _random(shape, _seed(index, name), device)
        setattr(experts, name, _parameter(weight))
        del weight
        with quantizing(name):
            bnb_parametrize.replace_parameter_4bit(experts, name, quant_type=QUANT_TYPE)
    if cache is not None and quantizer is not None and cached is None:
        cache.save(index, quantizer.made)
    return {"layer": index, "from_cache": cached is not None, "build_s": time.perf_counter() - started}


def build_model(
    layers: int,
    device: str = "cpu",
    cache_root: Path | None = DEFAULT_CACHE,
    shape: dict[str, Any] | None = None,
    chunk: int = CHUNK,
    on_layer: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """OLMoE-1B-7B's shapes with ``layers`` decoder layers, quantized as the report does.

    Only the router gates (``.mlp.gate.``) are trainable. ``cache_root=None`` quantizes with
    bitsandbytes' own ``quantize_4bit`` and keeps nothing (the CUDA path).
    """
    import torch
    from transformers import OlmoeForCausalLM

    config = olmoe_config(layers, shape)
    with torch.device("meta"):
        model = OlmoeForCausalLM(config)
    cache = LayerCache(cache_root, config) if cache_root is not None else None
    inner = model.model
    inner.embed_tokens.weight = _parameter(_random(tuple(inner.embed_tokens.weight.shape), SEED + 1, device))
    model.lm_head.weight = _parameter(_random(tuple(model.lm_head.weight.shape), SEED + 2, device))
    inner.norm.weight = _parameter(torch.ones(inner.norm.weight.shape, dtype=torch.bfloat16, device=device))
    inner.rotary_emb = type(inner.rotary_emb)(config=config, device=device)
    for index in range(layers):
        info = build_layer(model, index, device, cache, chunk)
        if on_layer is not None:
            on_layer(info)
    leftover = [
        name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta
    ]
    if leftover:
        raise RuntimeError(f"parameters left on the meta device: {leftover[:5]}")
    model.config.dtype = torch.bfloat16
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for name, parameter in model.named_parameters():
        if ".mlp.gate." in name:
            parameter.requires_grad_(True)
    return model
