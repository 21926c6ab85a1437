"""Finding the modules alive in this process that hold one of some hook functions, without importing torch.

It reads every object Python's collector tracks (about 0.1-0.2 µs each: tens of milliseconds to a second
in a large process), so only what runs rarely calls it: ``deactivate()``, and ``status()`` where the fix
is not in a library's code or the library was imported before the fix turned on and nothing was covered
yet. A training step with the fix on never does. A module awaiting collection (garbage in a reference
cycle) counts as alive until the collector frees it.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Collection
from typing import Any

PRE_HOOKS = "_forward_pre_hooks"
HOOKS = "_forward_hooks"


def modules_holding(functions: Collection[object], hooks: str) -> list[tuple[Any, dict[Any, Any]]]:
    """Every module alive (or awaiting collection) that holds one of ``functions`` among its ``hooks``
    (PRE_HOOKS or HOOKS), with those hooks. An object whose hooks cannot be read is left out."""
    module_type = getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)
    if module_type is None or not functions:
        return []
    modules = [each for each in gc.get_objects() if issubclass(type(each), module_type)]  # no __class__ read
    found = []
    for module in modules:
        registered = _hooks(module, functions, hooks)
        if registered is not None:
            found.append((module, registered))
    return found


def _hooks(module: Any, functions: Collection[object], hooks: str) -> dict[Any, Any] | None:
    """The module's ``hooks`` (a copy), where one of them is one of ``functions``; None otherwise."""
    try:
        registered = dict(vars(module).get(hooks) or {})  # a module made without __init__ has none
    except Exception:  # something in its __dict__ that is not a dictionary of hooks
        return None
    holding = any(hook is function for hook in registered.values() for function in functions)
    return registered if holding else None
