"""torch's parametrization cache and the fix's holds on it, read and released without importing torch.

``P._cache_enabled`` counts the holds on the cache (it is on while the count is not 0, below 0 included)
and ``P._cache`` keeps what parametrizations compute while it is on. Before torch's parametrize module is
imported nothing can be held, and every function here reads 0 or does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

PARAMETRIZE = "torch.nn.utils.parametrize"

#: What status and the safety nets say of holds on the counter that the fix's hooks did not take.
UNKNOWN_HOLDS = (
    "bnb-gc-fix cannot tell whose these holds are (a P.cached() block still open, another thread's forward, "
    "a forward begun before the fix turned on, or a pair of hooks the fix is not in: bitsandbytes' own where "
    "the fix is off or not needed); if nothing holds them on purpose, bnb_gc_fix.reset() releases them once "
    "nothing runs"
)


def parametrize() -> Any:
    """torch's parametrize module, or None while nothing has imported it."""
    return sys.modules.get(PARAMETRIZE)


def gate_if_imported() -> Any:
    """bnb-gc-fix's gate module, or None while nothing has imported it (then the fix's hooks never ran)."""
    return sys.modules.get("bnb_gc_fix.gate")


def counter() -> int:
    return int(getattr(parametrize(), "_cache_enabled", 0))


def cached_bytes() -> int:
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    values = getattr(parametrize(), "_cache", {}).values()
    return sum(v.numel() * v.element_size() for v in values if tensor is not None and isinstance(v, tensor))


def release_all() -> int:
    """Counter to 0 and the cache emptied, whoever holds it; returns how many holds there were."""
    before = max(counter(), 0)
    module = parametrize()
    if module is not None:
        module._cache_enabled = 0
        module._cache = {}
    return before
