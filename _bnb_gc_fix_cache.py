"""torch's parametrization cache, read and released without ever importing torch: ``_cache_enabled``
counts the holds on the global cache (on while not 0, below 0 included), ``_cache`` keeps what is computed
while it is on. Top-level and stdlib-only, for the pytest plugin (which must not import the package).
"""

from __future__ import annotations

import sys
from typing import Any

PARAMETRIZE = "torch.nn.utils.parametrize"
# What usually leaves the cache switched on: the sentence every report of a leak gives.
CAUSE = (
    "usually a forward left by an exception that skipped the forward hook switching the cache off: "
    "non-reentrant activation checkpointing stopping its recompute early (bitsandbytes 0.48-0.49 "
    "replace_parameter_4bit, axolotl <= 0.19 replace_parameter_8bit), or a KeyboardInterrupt (a "
    "notebook's stop button)"
)


def parametrize() -> Any:
    """torch's parametrize module, or None while nothing has imported it (then nothing is held)."""
    return sys.modules.get(PARAMETRIZE)


def counter() -> int:
    """The holds on the cache; 0 while torch's parametrize is not imported (or is being imported)."""
    return int(getattr(parametrize(), "_cache_enabled", 0))


def cached_bytes() -> int:
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    values = list(getattr(parametrize(), "_cache", {}).values())
    return sum(v.numel() * v.element_size() for v in values if tensor is not None and isinstance(v, tensor))


def give_back(count: int) -> None:
    """Give back ``count`` holds: the counter never goes below 0, and the cache is emptied at 0."""
    module = parametrize()
    if module is None:
        return
    remaining = module._cache_enabled - count  # no call before the write: the GIL never switches here
    if remaining > 0:
        module._cache_enabled = remaining
    else:
        module._cache_enabled = 0
        module._cache = {}


def reset(keep: int = 0) -> int:
    """Set the counter to ``keep`` holds (never below 0, which torch reads as on), emptying the cache at
    0 and every loaded gate's holds; returns how many holds were released."""
    module, before = parametrize(), counter()
    if keep <= 0 and (gate := sys.modules.get("bnb_gc_fix.gate")) is not None:
        gate.forget_holds()
    if module is not None:
        module._cache_enabled = max(keep, 0)
        if keep <= 0:
            module._cache = {}
    return max(before - max(keep, 0), 0)


def gil_enabled() -> bool:
    """False on a free-threaded Python running without the GIL: the counter's update is then not atomic."""
    return bool(getattr(sys, "_is_gil_enabled", lambda: True)())
