"""torch's parametrization cache, read and released without ever importing torch.

``_cache_enabled`` counts the holds on the global cache (the cache is on while it is not 0, below 0
included); ``_cache`` keeps what is computed while it is on. This module imports only the standard
library and the private package's words, for the pytest plugin, which must not import the public
package (importing that one turns the fix on). The public package learns of a :func:`reset` by
registering with :func:`on_reset`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import _bnb_gc_fix as words

PARAMETRIZE = "torch.nn.utils.parametrize"


def _affected(library: words.Facts, function: str) -> str:
    return f"{library.name} {library.first_affected} to before {library.first_fixed}: {function}"


#: What usually leaves the cache switched on: the sentence every report of a leak gives.
CAUSE = (
    "usually a forward left by an exception that skipped the forward hook switching the cache off: "
    "non-reentrant activation checkpointing stopping its recompute early ("
    f"{_affected(words.BITSANDBYTES, 'replace_parameter_4bit')}; "
    f"{_affected(words.AXOLOTL, words.AXOLOTL.register)}), "
    "or a KeyboardInterrupt (a notebook's stop button)"
)

_reset_callbacks: list[Callable[[], None]] = []


def on_reset(callback: Callable[[], None]) -> None:
    """Call ``callback()`` whenever :func:`reset` releases every hold (the gate forgets its own)."""
    if callback not in _reset_callbacks:
        _reset_callbacks.append(callback)


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
    remaining = module._cache_enabled - count  # no call before the write (see bnb_gc_fix.gate.LeaveHook)
    if remaining > 0:
        module._cache_enabled = remaining
    else:
        module._cache_enabled = 0
        module._cache = {}


def empty_at_zero() -> None:
    """A counter at or below zero back to zero, and the cache emptied; a counter above zero stays."""
    give_back(0)


def reset(keep: int = 0) -> int:
    """Set the counter to ``keep`` holds (never below 0, which torch reads as on); at 0, also empty the
    cache and tell whoever registered with :func:`on_reset`. Returns how many holds were released."""
    keep = max(keep, 0)
    before = counter()
    if keep == 0:
        for callback in _reset_callbacks:
            callback()
    module = parametrize()
    if module is not None:
        module._cache_enabled = keep
        if keep == 0:
            module._cache = {}
    return max(before - keep, 0)
