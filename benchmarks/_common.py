"""What the memory benchmarks share: their configurations, upstream's fix, the tiny OLMoE, cache
accounting. The measuring (rounds, ratios, results) is ``_harness.py``'s.

Not a test helper and not part of the package: the scripts in this folder import it by path
(``python benchmarks/<script>.py`` puts this folder first on ``sys.path``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
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


def upstream_hooks() -> tuple[Callable[..., None], Callable[..., None]]:
    """Upstream 0.50's ``(_register_parametrization_hooks, _disable_parametrization_cache)``.

    Upstream's fix registers the disable hook with ``always_call=True`` (torch then runs it
    when the forward raises) and clamps the counter at zero. Written here from that
    description, against the installed bitsandbytes 0.48-0.49, so that the package can be
    compared with upstream's fix on the same bitsandbytes.
    """
    from functools import partial

    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch
    import torch.nn.utils.parametrize as P

    def _disable_parametrization_cache(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        P._cache_enabled = max(0, P._cache_enabled - 1)
        if not P._cache_enabled:
            P._cache = {}

    enable = bnb_parametrize._enable_parametrization_cache
    state_dict_hook = bnb_parametrize._parametrized_state_dict_post_hook

    def _register_parametrization_hooks(module: torch.nn.Module, param_name: str) -> None:
        module.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
            partial(state_dict_hook, param_name=param_name)
        )
        module.register_forward_pre_hook(enable)
        module.register_forward_hook(_disable_parametrization_cache, always_call=True)

    return _register_parametrization_hooks, _disable_parametrization_cache


def apply_upstream_fix() -> None:
    """Patch the installed bitsandbytes (0.48-0.49) to register upstream 0.50's hooks."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    register, disable = upstream_hooks()
    bnb_parametrize._disable_parametrization_cache = disable
    bnb_parametrize._register_parametrization_hooks = register


def build_olmoe(layers: int, experts: int, hidden: int, device: str = "cpu", dtype: str = "float32") -> Any:
    """The tests' tiny OLMoE (``tests/scenarios/tiny_olmoe.py``): fused experts quantized to 4 bits,
    only the router gates trainable, built on ``device`` before quantizing."""
    sys.path.insert(0, str(ROOT / "tests" / "scenarios"))
    from tiny_olmoe import build

    model, _ = build(layers=layers, experts=experts, hidden=hidden, device=device, dtype=dtype)
    return model


def cache_state() -> tuple[int, int, int]:
    """torch's parametrization cache right now: (counter, entries, bytes held by its tensors)."""
    import torch
    import torch.nn.utils.parametrize as P

    held = 0
    for tensor in list(P._cache.values()):
        if isinstance(tensor, torch.Tensor):
            held += tensor.numel() * tensor.element_size()
    return int(P._cache_enabled), len(P._cache), held


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux), or None where /proc is not available."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")
