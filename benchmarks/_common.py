"""What the benchmarks share besides the measuring (``_harness.py``): the configurations and upstream's
fix, a worker's training step and its evidence, the tiny OLMoE, hand-built pairs and gates.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from _harness import ROOT

#: The three configurations of the memory benchmark, in the order they are reported.
UNFIXED = "unfixed"
PACKAGE = "bnb-gc-fix"
UPSTREAM = "upstream-0.50"
CONFIGS = (UNFIXED, PACKAGE, UPSTREAM)
DESCRIPTIONS = {
    UNFIXED: "bitsandbytes as installed, BNB_GC_FIX=0",
    PACKAGE: "bitsandbytes as installed + import bnb_gc_fix",
    UPSTREAM: "bitsandbytes as installed, BNB_GC_FIX=0, upstream 0.50's hooks patched in by the benchmark",
}


def config_env(config: str) -> dict[str, str]:
    """The environment of a fresh subprocess running ``config``.

    The package's start-up hook (``bnb_gc_fix.pth``) would activate the fix in every process
    of a venv where it is installed, so the two configurations without it switch it off.
    """
    env = dict(os.environ)
    env.pop("BNB_GC_FIX", None)
    if config != PACKAGE:
        env["BNB_GC_FIX"] = "0"
    # bitsandbytes' CPU backend warns about torch._check_is_size on every quantization call.
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


#: bitsandbytes 0.50.2's disable hook, verbatim but for its comment and annotations.
UPSTREAM_DISABLE = """
def _disable_parametrization_cache(module, inputs, output):
    P._cache_enabled = max(0, P._cache_enabled - 1)
    if not P._cache_enabled:
        P._cache = {}
"""


@functools.cache
def upstream_hooks() -> tuple[Callable[..., None], Callable[..., None]]:
    """Upstream 0.50's ``(_register_parametrization_hooks, _disable_parametrization_cache)``.

    Upstream's fix registers the disable hook with ``always_call=True`` (torch then runs it
    when the forward raises) and clamps the counter at zero. Its disable hook is 0.50.2's code
    (``UPSTREAM_DISABLE``) compiled in the installed bitsandbytes.nn.parametrize's namespace, so it reads
    ``P`` as 0.50's own does; its enable hook is the installed one (the same code in 0.48-0.50). So the
    package can be compared with upstream's fix on the same bitsandbytes. Made once: every module gets
    the same two functions, as in 0.50.
    """
    from functools import partial

    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    defined: dict[str, Any] = {}
    exec(UPSTREAM_DISABLE, vars(bnb_parametrize), defined)
    disable: Callable[..., None] = defined["_disable_parametrization_cache"]
    enable = bnb_parametrize._enable_parametrization_cache
    state_dict_hook = bnb_parametrize._parametrized_state_dict_post_hook

    def _register_parametrization_hooks(module: torch.nn.Module, param_name: str) -> None:
        module.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
            partial(state_dict_hook, param_name=param_name)
        )
        module.register_forward_pre_hook(enable)
        module.register_forward_hook(disable, always_call=True)

    return _register_parametrization_hooks, disable


def apply_upstream_fix() -> None:
    """Patch the installed bitsandbytes (0.48-0.49) to register upstream 0.50's hooks."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    register, disable = upstream_hooks()
    bnb_parametrize._disable_parametrization_cache = disable
    bnb_parametrize._register_parametrization_hooks = register


def start(config: str, threads: int | None) -> None:
    """A worker's first act: the configuration's fix (the package's import, or upstream's hooks)."""
    if config == PACKAGE:
        import bnb_gc_fix  # noqa: F401  (the import activates the fix)
    import torch

    if threads:
        torch.set_num_threads(threads)
    if config == UPSTREAM:
        apply_upstream_fix()


def fix_state(config: str) -> dict[str, Any]:
    """Evidence that a worker runs the configuration it claims to run (SystemExit where it does not)."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    register = bnb_parametrize._register_parametrization_hooks
    state: dict[str, Any] = {
        "bnb_gc_fix_imported": "bnb_gc_fix" in sys.modules,
        "register_hooks": type(register).__name__,
        "register_hooks_module": getattr(register, "__module__", None),
    }
    if "bnb_gc_fix" in sys.modules:
        status = sys.modules["bnb_gc_fix"].status()
        state["active"] = status.active
        state["reason"] = status.reason
    if config == PACKAGE and not state.get("active"):
        raise SystemExit(f"bnb-gc-fix is not active in the {config} worker: {state}")
    if config != PACKAGE and state["bnb_gc_fix_imported"]:
        raise SystemExit(f"bnb_gc_fix was imported in the {config} worker (is BNB_GC_FIX=0 set?)")
    return state


def trainer(model: Any, lr: float, batch: int, seq: int, device: str) -> tuple[Any, Any, list[Any]]:
    """The report's loop around ``model``: (AdamW over its trainable parameters, fixed random input ids,
    those parameters)."""
    import torch

    model.config.use_cache = False
    model.train()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
    return optimizer, ids, trainable


def train_step(model: Any, ids: Any, optimizer: Any, step: int, cuda: bool) -> dict[str, Any]:
    """One training step, timed, and what it left behind: torch's cache, resident memory (and CUDA's)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    counter, entries, cached = cache_state()
    status = proc_status()
    record: dict[str, Any] = {
        "step": step,
        "step_s": elapsed,
        "loss": float(loss.item()),
        "counter": counter,
        "cache_entries": entries,
        "cache_bytes": cached,
        "rss_bytes": status.get("VmRSS"),
        "peak_rss_bytes": status.get("VmHWM"),
    }
    if cuda:
        record["allocated_bytes"] = torch.cuda.memory_allocated()
        record["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return record


def cache_state() -> tuple[int, int, int]:
    """torch's parametrization cache right now: (counter, entries, bytes held by its tensors)."""
    import torch
    import torch.nn.utils.parametrize as P

    held = 0
    for tensor in list(P._cache.values()):
        if isinstance(tensor, torch.Tensor):
            held += tensor.numel() * tensor.element_size()
    return int(P._cache_enabled), len(P._cache), held


def proc_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The fields ``keys`` (kB, given in bytes) of a /proc file; empty where there is no /proc."""
    found: dict[str, int] = {}
    try:
        with open(path) as fields:
            for line in fields:
                key, _, value = line.partition(":")
                if key in keys:
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (bytes) of a process."""
    return proc_fields(f"/proc/{pid}/status", ("VmRSS", "VmHWM"))


def build_olmoe(layers: int, experts: int, hidden: int, device: str = "cpu", dtype: str = "float32") -> Any:
    """The tests' tiny OLMoE (``tests/scenarios/tiny_olmoe.py``): fused experts quantized to 4 bits,
    only the router gates trainable, built on ``device`` before quantizing."""
    sys.path.insert(0, str(ROOT / "tests" / "scenarios"))
    from tiny_olmoe import build

    model, _ = build(layers=layers, experts=experts, hidden=hidden, device=device, dtype=dtype)
    return model


def same_outputs(modules: dict[str, Any], *args: Any) -> None:
    """Assert that every configuration's module computes the same output from ``args`` (no grad)."""
    import torch

    with torch.no_grad():
        outputs = [module(*args) for module in modules.values()]
    assert all(torch.equal(outputs[0], output) for output in outputs)


def unpatched_bitsandbytes() -> Callable[..., None]:
    """bitsandbytes' own ``_register_parametrization_hooks``, the patch removed if the start-up hook
    applied it (the scripts that build plain pairs and gates by hand set ``BNB_GC_FIX=0`` first)."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    import _bnb_gc_fix as words
    from bnb_gc_fix import patch

    if patch.is_applied(bnb_parametrize, words.BITSANDBYTES):
        patch.remove(bnb_parametrize, words.BITSANDBYTES)
    register: Callable[..., None] = bnb_parametrize._register_parametrization_hooks
    return register


#: The hooks a hand-built quantized module carries (``quantized``): bitsandbytes 0.49's plain pair per
#: parameter, bitsandbytes 0.50's always-called pair per parameter, or one gate in the place of 0.49's.
PAIRS_049 = "0.49 pairs"
PAIRS_050 = "0.50 pairs"
GATED = "gate"


@contextlib.contextmanager
def _registering(register: Callable[..., None]) -> Iterator[None]:
    """bitsandbytes' ``_register_parametrization_hooks`` is ``register`` inside the block."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    own = bnb_parametrize._register_parametrization_hooks
    bnb_parametrize._register_parametrization_hooks = register
    try:
        yield
    finally:
        bnb_parametrize._register_parametrization_hooks = own


def quantized(module: Any, hooks: str, names: tuple[str, ...] = ("weight",)) -> Any:
    """``module`` with ``names`` quantized by ``replace_parameter_4bit`` (nf4), carrying ``hooks``:
    ``PAIRS_049`` (bitsandbytes' own plain pair each), ``PAIRS_050`` (0.50's always-called pair each,
    ``upstream_hooks``) or ``GATED`` (0.49's pairs, then ``bnb_gc_fix.hooks.install``: one gate)."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    from bnb_gc_fix import gate
    from bnb_gc_fix import hooks as gate_hooks

    register = upstream_hooks()[0] if hooks == PAIRS_050 else unpatched_bitsandbytes()
    with _registering(register):
        for name in names:
            bnb_parametrize.replace_parameter_4bit(module, name, quant_type="nf4")
    if hooks == GATED:
        assert gate_hooks.install(module)
    assert (gate.Gate.of(module) is not None) is (hooks == GATED)
    pairs = 1 if hooks == GATED else len(names)
    assert len(module._forward_pre_hooks) == pairs and len(module._forward_hooks) == pairs
    always = len(module._forward_hooks_always_called)
    assert always == (0 if hooks == PAIRS_049 else pairs), (hooks, always)
    return module.requires_grad_(False)


def dequantizations(module: Any, call: Callable[[], Any]) -> int:
    """How often one ``call`` dequantizes ``module``'s quantized parameters (calls of their
    parametrizations' forwards, which run ``dequantize_4bit``), all of them together."""
    count = 0
    counted_ones = [module.parametrizations[name][0] for name in module.parametrizations]

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            count += 1
            return original(*args, **kwargs)

        return counted

    for parametrization in counted_ones:
        parametrization.forward = counting(parametrization.forward)
    try:
        call()
    finally:
        for parametrization in counted_ones:
            del parametrization.forward
    return count
