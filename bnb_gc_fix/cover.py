"""Covering a module: its libraries' pairs of hooks become one pair whose off hook torch always calls.

A library registers one pair per quantized parameter. Before a module's first switch-on the fix *covers*
it: the first pre-hook of a fixed pair and the last off hook stay, each in its place, so every other hook
of the module runs when it ran before relative to the cache switching on and off, and the off hook is
marked always called. torch's hook dictionaries are edited in place, so every handle's ``remove()`` keeps
working, and modules that share them (DataParallel's replicas) are covered together. Imports no torch.

The record of covered modules holds those alive: an entry goes when its module is collected.
"""

from __future__ import annotations

import weakref
from types import FunctionType
from typing import Any

from bnb_gc_fix import ledger, lock

#: Every pair of hook functions the fix gave its code, as (pre-hook, off hook), with its library's name:
#: the one record of what was patched (``patch.apply`` adds to it; a library module imported again adds
#: its new pair).
FIXED_PAIRS: dict[tuple[FunctionType, FunctionType], str] = {}

#: The modules alive whose switch-ons the fix records, by ``id``: those it covered, and those it cannot
#: cover (``_uncoverable``).
_covered: dict[int, weakref.ref[Any]] = {}
#: The modules alive that hold a fixed off hook but no fixed pre-hook (another tool put a function of its
#: own in the place of the library's pre-hook, which calls the fixed one): the fix cannot fold their pairs
#: or mark their off hooks, so an exception leaving their forward still leaves the cache on, until their
#: next forward; their switch-ons are recorded all the same, so that an off hook gives back only its own.
_uncoverable: weakref.WeakSet[Any] = weakref.WeakSet()


def _is_fixed_pre_hook(hook: object) -> bool:
    return any(hook is pre_hook for pre_hook, _ in FIXED_PAIRS)


def _is_fixed_off_hook(hook: object) -> bool:
    return any(hook is off_hook for _, off_hook in FIXED_PAIRS)


def _off_hook_of(pre_hook: object) -> FunctionType:
    return next(off_hook for each, off_hook in FIXED_PAIRS if each is pre_hook)


def cover(module: Any) -> bool:
    """Make the module hold one fixed pair, its off hook always called, in the places of its first fixed
    pre-hook and its last fixed off hook (every other hook keeps its place); returns whether the fix
    records its switch-ons now (it holds such a pair, or it cannot be covered). Never raises."""
    try:
        with lock.held():
            return _fold(module)
    except Exception:  # hook dictionaries that do not look as torch's: the library's own behaviour
        return False


def _fold(module: Any) -> bool:
    pre_hooks = module._forward_pre_hooks
    pre_keys = [key for key, hook in pre_hooks.items() if _is_fixed_pre_hook(hook)]
    if not pre_keys:
        return _recorded_if_uncoverable(module)
    off_hooks = module._forward_hooks
    always = module._forward_hooks_always_called
    off_keys = [key for key, hook in off_hooks.items() if _is_fixed_off_hook(hook)]
    for key in pre_keys[1:]:
        del pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in off_keys[:-1]:
        del off_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        always.pop(key, None)
    if off_keys:
        always[off_keys[-1]] = True
    else:
        module.register_forward_hook(_off_hook_of(pre_hooks[pre_keys[0]]), always_call=True)
    _record(module)
    return True


def _record(module: Any) -> None:
    """Note the module as one whose switch-ons the fix records, once; its collection switches them off."""
    key = id(module)
    if key in _covered:
        return
    _covered[key] = weakref.ref(module)
    collected = weakref.finalize(module, _collected, key)
    collected.atexit = False  # nothing for a module alive at exit, or collected as the interpreter ends


def _recorded_if_uncoverable(module: Any) -> bool:
    """A module with no fixed pre-hook: where it holds a fixed off hook (another tool's pre-hook in the
    place of the fixed one), record it; else it is nothing of the fix's (a direct call of the library's
    hook function on a module of its own)."""
    if not any(_is_fixed_off_hook(hook) for hook in module._forward_hooks.values()):
        return False
    _uncoverable.add(module)
    _record(module)
    return True


def _collected(key: int) -> None:
    _covered.pop(key, None)
    ledger.module_collected(key)


def covered_ids() -> dict[int, weakref.ref[Any]]:
    """The record itself, for the pre-hook to look a module up in (a dictionary lookup, no call)."""
    return _covered


def is_covered(module: Any) -> bool:
    return id(module) in _covered


def covered_modules() -> list[Any]:
    modules = (ref() for ref in list(_covered.values()))
    return [module for module in modules if module is not None]


def _fixed_pairs_of(library_name: str) -> list[tuple[FunctionType, FunctionType]]:
    return [pair for pair, name in FIXED_PAIRS.items() if name == library_name]


def number_covered(library_name: str) -> int:
    """How many covered modules hold one of the library's fixed pre-hooks (never one it cannot cover)."""
    pre_hooks = [pre_hook for pre_hook, _ in _fixed_pairs_of(library_name)]
    return sum(
        any(hook is pre_hook for hook in module._forward_pre_hooks.values() for pre_hook in pre_hooks)
        for module in covered_modules()
    )


def number_uncoverable(library_name: str) -> int:
    """How many modules alive the fix could not cover hold one of the library's fixed off hooks."""
    off_hooks = [off_hook for _, off_hook in _fixed_pairs_of(library_name)]
    modules = list(_uncoverable)
    return sum(
        any(hook is off_hook for hook in module._forward_hooks.values() for off_hook in off_hooks)
        for module in modules
    )


def off_hooks_all_plain(module: Any) -> bool:
    """Whether none of the module's fixed off hooks is marked always called: then a forward that began
    before the fix covered it took the library's own +1 at each of its pre-hooks, and each of its off hooks
    gives one back as the library's would (torch calls a plain hook only after the forward returned). A
    deep copy of a covered module keeps its mark, and gives nothing back that it did not take."""
    always = getattr(module, "_forward_hooks_always_called", {})
    hooks = getattr(module, "_forward_hooks", {})
    return not any(key in always for key, hook in hooks.items() if _is_fixed_off_hook(hook))
