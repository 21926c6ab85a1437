"""Counting the modules alive in this process that leak this way, without importing torch.

A module leaks this way when it holds an off hook of a library's module (a forward hook defined there)
that torch does not always call: what a library that leaks registers, and what the fix's cover changes.
Finding them means reading every object Python's collector tracks (about 0.1-0.2 µs each: tens of
milliseconds to a second in a large process). ``status()`` does that only where the fix does not see the
modules quantized (the fix off, its hooks not fixable, a library module imported where it could not see
it). Where the fix turns on after a library's module was imported (a late ``import bnb_gc_fix`` or
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

#: The modules noted at a late activation, by the name of the library module whose plain off hook they
#: held, then by ``id``: an entry goes when its module is collected.
_noted: dict[str, dict[int, weakref.ref[Any]]] = {}


def leaking_modules(module_name: str, modules: list[Any] | None = None) -> int:
    """How many of ``modules`` (None: every module alive) hold an off hook defined in ``module_name`` that
    torch does not always call. An object whose hooks cannot be read is left out."""
    if modules is None:
        modules = _every_module()
    return sum(_leaks(module, module_name) for module in modules)


def note_the_leaking(module_name: str) -> None:
    """Note the modules alive that leak through ``module_name``'s hooks (a read of every object)."""
    noted = _noted.setdefault(module_name, {})
    for module in _every_module():
        if _leaks(module, module_name):
            _note(noted, module)


def noted(module_name: str) -> list[Any]:
    """The modules noted for ``module_name`` that are alive."""
    modules = (ref() for ref in list(_noted.get(module_name, {}).values()))
    return [module for module in modules if module is not None]


def _note(noted: dict[int, weakref.ref[Any]], module: Any) -> None:
    key = id(module)

    def forget(ref: weakref.ref[Any]) -> None:  # the module was collected
        if noted.get(key) is ref:
            del noted[key]

    noted[key] = weakref.ref(module, forget)


def _every_module() -> list[Any]:
    module_type = getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)
    if module_type is None:
        return []
    return [each for each in gc.get_objects() if issubclass(type(each), module_type)]  # no __class__ read


def defined_in(hook: Any) -> str | None:
    """The module a hook's function was defined in (through functools.partial objects)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None)


def _leaks(module: Any, module_name: str) -> bool:
    try:
        hooks = dict(vars(module).get("_forward_hooks") or {})  # a module made without __init__ has none
        always = dict(vars(module).get("_forward_hooks_always_called") or {})
        skipped = [hook for key, hook in hooks.items() if key not in always]
        return any(defined_in(hook) == module_name for hook in skipped)
    except Exception:  # something in its __dict__ that is not a dictionary of hooks
        return False
