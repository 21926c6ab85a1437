"""Finding the modules alive in this process that hold one of some hook functions, without importing torch.

It reads every object Python's collector tracks (tens of milliseconds in a large process), so only what
runs rarely calls it: ``deactivate()``, and ``status()`` where the fix is not in a library's code or the
library was imported before the fix turned on. A training step with the fix on never does.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Collection
from typing import Any

PRE_HOOKS = "_forward_pre_hooks"
HOOKS = "_forward_hooks"


def modules_holding(functions: Collection[object], hooks: str) -> list[Any]:
    """Every module alive that holds one of ``functions`` among its ``hooks`` (PRE_HOOKS or HOOKS)."""
    module_type = getattr(getattr(sys.modules.get("torch"), "nn", None), "Module", None)
    if module_type is None or not functions:
        return []
    modules = [each for each in gc.get_objects() if issubclass(type(each), module_type)]  # no __class__ read
    return [module for module in modules if _holds(module, functions, hooks)]


def _holds(module: Any, functions: Collection[object], hooks: str) -> bool:
    registered = vars(module).get(hooks)  # a module made without __init__ has none
    if registered is None:
        return False
    return any(hook is function for hook in list(registered.values()) for function in functions)
