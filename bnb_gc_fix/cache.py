"""torch's parametrization cache, read and switched off without importing torch.

``P._cache_enabled`` is the counter (the cache is on while it is not 0, below 0 included) and ``P._cache``
keeps what parametrizations compute while it is on. Before torch's parametrize module is imported nothing
can have switched it on, and every function here reads 0 or does nothing.
"""

from __future__ import annotations

import sys
from typing import Any

PARAMETRIZE = "torch.nn.utils.parametrize"


def parametrize() -> Any:
    """torch's parametrize module, or None while nothing has imported it."""
    return sys.modules.get(PARAMETRIZE)


def counter() -> int:
    return int(getattr(parametrize(), "_cache_enabled", 0))


def cached_bytes() -> int:
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    values = getattr(parametrize(), "_cache", {}).values()
    return sum(v.numel() * v.element_size() for v in values if tensor is not None and isinstance(v, tensor))


def switch_off(torch_parametrize: Any, count: int) -> None:
    """Take ``count`` switch-ons off the counter of torch's parametrize module (given by the caller, which
    has it already), never below 0; the cache is emptied at 0. With nothing to take off, the counter is
    neither read nor written."""
    if count <= 0:
        return
    remaining = torch_parametrize._cache_enabled - count
    if remaining > 0:
        torch_parametrize._cache_enabled = remaining
    else:
        torch_parametrize._cache_enabled = 0
        torch_parametrize._cache = {}
