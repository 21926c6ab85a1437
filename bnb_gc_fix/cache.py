"""torch's parametrization cache, read and released without importing torch; ``bnb_gc_fix.reset()``.

``P._cache_enabled`` counts the holds on the cache (it is on while the count is not 0, below 0 included)
and ``P._cache`` keeps what parametrizations compute while it is on. Before torch's parametrize module is
imported nothing can be held, and every function here reads 0 or does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

PARAMETRIZE = "torch.nn.utils.parametrize"


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


def reset() -> int:
    """``bnb_gc_fix.reset()``: release torch's parametrization cache, whoever switched it on. The counter
    goes to 0, the cache is emptied, and the fix forgets what its hooks had switched on. Returns the counter
    as it stood (0 while torch's parametrize module is not imported). Never imports torch."""
    module = parametrize()
    if module is None:
        return 0
    gate = gate_if_imported()
    if gate is not None:
        gate.forget_every_hold()
    before = max(counter(), 0)
    module._cache_enabled = 0
    module._cache = {}
    return before
