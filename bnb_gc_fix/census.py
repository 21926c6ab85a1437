"""Counting the modules alive in this process that leak this way, without importing torch.

A module leaks this way when it holds an off hook of a library's module (a forward hook defined there)
that torch does not always call: what a library that leaks registers, and what the fix's cover changes.
Only ``status()`` counts them, where the fix is not in a library's code or the library was imported
before the fix turned on. It reads every object Python's collector tracks (about 0.1-0.2 µs each: tens
of milliseconds to a second in a large process); a training step never does. A module awaiting collection
(garbage in a reference cycle) counts as alive until the collector frees it.
"""

from __future__ import annotations

import functools
import gc
import sys
from typing import Any


def leaking_modules(module_name: str) -> int:
    """How many modules alive hold an off hook defined in ``module_name`` that torch does not always call.
    An object whose hooks cannot be read is left out."""
    module_type = getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)
    if module_type is None:
        return 0
    modules = [each for each in gc.get_objects() if issubclass(type(each), module_type)]  # no __class__ read
    return sum(_leaks(module, module_name) for module in modules)


def _defined_in(hook: Any) -> str | None:
    """The module a hook's function was defined in (through functools.partial objects)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__module__", None)


def _leaks(module: Any, module_name: str) -> bool:
    try:
        hooks = dict(vars(module).get("_forward_hooks") or {})  # a module made without __init__ has none
        always = dict(vars(module).get("_forward_hooks_always_called") or {})
        skipped = [hook for key, hook in hooks.items() if key not in always]
        return any(_defined_in(hook) == module_name for hook in skipped)
    except Exception:  # something in its __dict__ that is not a dictionary of hooks
        return False
