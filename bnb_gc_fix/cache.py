"""torch's parametrization cache, read and switched off without importing torch; ``bnb_gc_fix.reset()``.

``P._cache_enabled`` is the counter (the cache is on while it is not 0, below 0 included) and ``P._cache``
keeps what parametrizations compute while it is on. Before torch's parametrize module is imported nothing
can have switched it on, and every function here reads 0 or does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

PARAMETRIZE = "torch.nn.utils.parametrize"

#: Advice that holds wherever it is given: reset() inside an open ``P.cached()`` block leaves the counter
#: at -1 when the block ends, and the cache on for good.
RESET_ADVICE = "bnb_gc_fix.reset() switches it off, once no forward runs and no P.cached() block is open"


def parametrize() -> Any:
    """torch's parametrize module, or None while nothing has imported it."""
    return sys.modules.get(PARAMETRIZE)


def counter() -> int:
    return int(getattr(parametrize(), "_cache_enabled", 0))


def cached_bytes() -> int:
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    values = getattr(parametrize(), "_cache", {}).values()
    return sum(v.numel() * v.element_size() for v in values if tensor is not None and isinstance(v, tensor))


def switch_off(module: Any, count: int) -> None:
    """Take ``count`` switch-ons off the counter of ``module`` (torch's parametrize module, given by the
    caller: the hooks bind it), never below 0; the cache is emptied at 0. With nothing to take off, the
    counter is neither read nor written."""
    if count <= 0:
        return
    remaining = module._cache_enabled - count
    if remaining > 0:
        module._cache_enabled = remaining
    else:
        module._cache_enabled = 0
        module._cache = {}


def reset() -> int:
    """``bnb_gc_fix.reset()``: switch torch's parametrization cache off, whoever switched it on. The counter
    goes to 0, the cache is emptied, and the fix forgets what its forwards had switched on. Returns the
    counter as it stood (0 while torch's parametrize module is not imported). Never imports torch. Inside
    an open ``P.cached()`` block the counter ends at -1 when the block does: call it once no forward runs
    and no such block is open."""
    from bnb_gc_fix import ledger

    module = parametrize()
    if module is None:
        return 0
    ledger.forget_every_thread()
    before = max(counter(), 0)
    module._cache_enabled = 0
    module._cache = {}
    return before
