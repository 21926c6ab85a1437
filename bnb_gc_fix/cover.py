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

#: Every pair of hook functions the fix gave its code, as (pre-hook, off hook): the one record of what
#: was patched (``patch.apply`` adds to it; a library module imported again adds its new pair).
FIXED_PAIRS: list[tuple[FunctionType, FunctionType]] = []

#: The covered modules alive, by ``id``.
_covered: dict[int, weakref.ref[Any]] = {}
#: The modules alive that hold a fixed off hook but no fixed pre-hook (another tool put a function of its
#: own in the place of the library's pre-hook): the fix cannot cover them, and they leak as without it.
_uncoverable: weakref.WeakSet[Any] = weakref.WeakSet()


def _is_fixed_pre_hook(hook: object) -> bool:
    return any(hook is pre_hook for pre_hook, _ in FIXED_PAIRS)


def _is_fixed_off_hook(hook: object) -> bool:
    return any(hook is off_hook for _, off_hook in FIXED_PAIRS)


def _off_hook_of(pre_hook: object) -> FunctionType:
    return next(off_hook for each, off_hook in FIXED_PAIRS if each is pre_hook)


def cover(module: Any) -> bool:
    """Make the module hold one fixed pair, its off hook always called, in the places of its first fixed
    pre-hook and its last fixed off hook (every other hook keeps its place); returns whether it holds such
    a pair now. Never raises."""
    try:
        with lock.held():
            return _fold(module)
    except Exception:  # hook dictionaries that do not look as torch's: the library's own behaviour
        return False


def _fold(module: Any) -> bool:
    pre_hooks = module._forward_pre_hooks
    pre_keys = [key for key, hook in pre_hooks.items() if _is_fixed_pre_hook(hook)]
    if not pre_keys:
        _note_if_uncoverable(module)
        return False
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
    key = id(module)
    if key not in _covered:
        _covered[key] = weakref.ref(module)
        collected = weakref.finalize(module, _collected, key)
        collected.atexit = False  # nothing for a module alive at exit, or collected as the interpreter ends
    return True


def _note_if_uncoverable(module: Any) -> None:
    if any(_is_fixed_off_hook(hook) for hook in module._forward_hooks.values()):
        _uncoverable.add(module)


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


def number_holding(pre_hooks: list[object]) -> int:
    """How many covered modules hold one of ``pre_hooks`` (a library's fixed pre-hooks)."""
    return sum(
        any(hook is pre_hook for hook in module._forward_pre_hooks.values() for pre_hook in pre_hooks)
        for module in covered_modules()
    )


def number_uncoverable(off_hooks: list[object]) -> int:
    """How many modules alive the fix could not cover hold one of ``off_hooks`` (a library's fixed ones)."""
    modules = list(_uncoverable)
    return sum(
        any(hook is off_hook for hook in module._forward_hooks.values() for off_hook in off_hooks)
        for module in modules
    )


def off_hook_still_plain(module: Any) -> bool:
    """Whether the module's last fixed off hook is not marked always called (or it holds none): then a
    forward that began before the fix covered it took the library's own +1, which its off hook gives back
    as the library would (torch calls a plain hook only after the forward and its pre-hooks ran)."""
    always = getattr(module, "_forward_hooks_always_called", {})
    hooks = getattr(module, "_forward_hooks", {})
    off_keys = [key for key, hook in hooks.items() if _is_fixed_off_hook(hook)]
    return not off_keys or off_keys[-1] not in always
