"""Waiting for a module that is still being imported: call back once its code has run.

The start-up hook activates the fix on the first import of bitsandbytes. axolotl's
``moe_quant`` imports bitsandbytes at its top, so the fix can be activated while ``moe_quant`` is
half-initialised: in ``sys.modules`` already, its functions not defined yet. A wrapt post-import
hook would be called at once, on that half module. Instead this watches the module's spec: the
import machinery sets ``spec._initializing = False`` (``importlib._bootstrap._load_unlocked``, on
every Python this package supports) right after the module's code has run, whether it succeeded
or raised, and before the import statement returns to its caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()
_CALLBACKS: dict[int, list[Callable[[], None]]] = {}


def initializing(module: ModuleType) -> bool:
    """Whether ``module``'s code is still running (the import machinery's own test)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _Watched(ModuleSpec):
    """Swapped in as the class of an in-flight module's spec; swapped back when it completes."""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "_initializing" and not value:
            object.__setattr__(self, "__class__", ModuleSpec)
            with _LOCK:
                callbacks = _CALLBACKS.pop(id(self), [])
            _call(callbacks)


def _call(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # never break the user's import
            pass


def when_complete(module: ModuleType, callback: Callable[[], None]) -> bool:
    """Call ``callback()`` once ``module`` has finished importing (or failed to).

    Returns False when the module cannot be watched (its spec is not a plain ``ModuleSpec``) or
    is not being imported any more; the callback is then not called.
    """
    spec = getattr(module, "__spec__", None)
    if spec is None or type(spec) not in (ModuleSpec, _Watched):
        return False
    with _LOCK:
        _CALLBACKS.setdefault(id(spec), []).append(callback)
        if type(spec) is ModuleSpec:
            spec.__class__ = _Watched
        if initializing(module):
            return True
        # It completed meanwhile, perhaps before the swap: nothing will call back.
        # Earlier callers were answered True and are called back below.
        callbacks = _CALLBACKS.pop(id(spec), [])
        callbacks.remove(callback)
        if type(spec) is _Watched:
            object.__setattr__(spec, "__class__", ModuleSpec)
    _call(callbacks)
    return False
