"""Counting the modules alive in this process quantized with a library's module, without importing torch.

A module was quantized with a library's module when it holds a forward hook, a pre-hook or a
parametrization defined there.
Finding them means reading every object Python's collector tracks (about 0.1-0.2 µs each: tens of
milliseconds to a second in a large process). ``status()`` does that only where the fix does not see the
modules quantized (the fix off, not in the library's hooks, a library module imported where it could not
see it). Where the fix turns on after a library's module was imported (a late ``import bnb_gc_fix`` or
``activate()``, never the start-up hook's import at that module's), the modules quantized before are read
once, then and there, and noted: ``status()`` looks them up. A module awaiting collection (garbage in a
reference cycle) counts as alive until the collector frees it.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from typing import Any

#: The modules noted at a late activation, by the name of the library module whose hooks they held, then
#: by ``id``: an entry goes when its module is collected.
_noted: dict[str, weakref.WeakValueDictionary[int, Any]] = {}


def quantized_with(module_name: str) -> int:
    """How many modules alive hold a hook defined in ``module_name``. An object whose hooks cannot be read is
    left out."""
    return sum(_holds_a_hook_of(module, module_name) for module in _every_module())


def note_quantized(module_name: str) -> None:
    """Note the modules alive that hold a hook defined in ``module_name`` (a read of every object)."""
    noted = _noted.setdefault(module_name, weakref.WeakValueDictionary())
    for module in _every_module():
        if _holds_a_hook_of(module, module_name):
            noted[id(module)] = module


def noted(module_name: str) -> list[Any]:
    """The modules noted for ``module_name`` that are alive."""
    return list(_noted.get(module_name, {}).values())


def module_class() -> Any:
    """``torch.nn.Module``, where torch is imported (None: not yet); nothing is imported."""
    return getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)


def _every_module() -> list[Any]:
    module_type = module_class()
    if module_type is None:
        return []
    return [each for each in gc.get_objects() if issubclass(type(each), module_type)]  # no __class__ read


def _defined_in(hook: Any) -> str | None:
    """The module a hook's function was defined in (through functools.partial objects)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None)


def _holds_a_hook_of(module: Any, module_name: str) -> bool:
    """Whether the module holds a hook, or a parametrization, defined in ``module_name`` (a builtin hook
    names no module: the parametrization the library put there tells)."""
    try:
        attributes = vars(module)  # a module made without __init__ has no hook dictionaries
        hooks = [*(attributes.get("_forward_pre_hooks") or {}).values()]
        hooks += (attributes.get("_forward_hooks") or {}).values()
        lists = (attributes.get("_modules") or {}).get("parametrizations")
        hooks += [type(each) for values in (lists or {}).values() for each in values]
        return any(_defined_in(hook) == module_name for hook in hooks)
    except Exception:  # something in its __dict__ that is not a dictionary of hooks
        return False
