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
#: the one record of what was patched (``patch.put_in`` adds to it; a library module imported again adds
#: its new pair).
FIXED_PAIRS: dict[tuple[FunctionType, FunctionType], str] = {}

#: The covered modules alive, by ``id``: the pre-hook's fast path looks a module up here.
_covered: dict[int, weakref.ref[Any]] = {}
#: The modules alive that hold a fixed off hook but no fixed pre-hook, by ``id``: another tool put a
#: function of its own in the place of the library's pre-hook, which calls the fixed one. The fix cannot
#: fold their pairs, so they run the library's own arithmetic, their off hooks no longer marked always
#: called: what an exception leaves on stays on, as without the fix (``bnb_gc_fix.hooks``).
_uncoverable: dict[int, weakref.ref[Any]] = {}


def _is_fixed_pre_hook(hook: object) -> bool:
    return any(hook is pre_hook for pre_hook, _ in FIXED_PAIRS)


def _is_fixed_off_hook(hook: object) -> bool:
    return any(hook is off_hook for _, off_hook in FIXED_PAIRS)


def _off_hook_of(pre_hook: object) -> FunctionType:
    return next(off_hook for each, off_hook in FIXED_PAIRS if each is pre_hook)


def cover(module: Any) -> bool:
    """Make the module hold one fixed pair, its off hook always called, in the places of its first fixed
    pre-hook and its last fixed off hook (every other hook keeps its place); returns whether it is covered
    now. A module that holds a fixed off hook but no fixed pre-hook is noted as one the fix cannot cover,
    once and for good. Never raises."""
    if id(module) in _uncoverable:
        return False
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
    _record(module, _covered)
    return True


def _record(module: Any, record: dict[int, weakref.ref[Any]]) -> None:
    """Note the module in ``record`` (once); its collection drops it there and switches off every thread's
    switch-ons for it."""
    key = id(module)
    if key in record:
        return
    record[key] = weakref.ref(module)
    collected = weakref.finalize(module, _collected, key, record)
    collected.atexit = False  # nothing for a module alive at exit, or collected as the interpreter ends


def _note_if_uncoverable(module: Any) -> None:
    """A module with no fixed pre-hook: where it holds a fixed off hook (another tool's pre-hook in the
    place of the fixed one), note it as one the fix cannot cover, and unmark its fixed off hooks (a deep
    copy of a covered module keeps the mark), unless a covered module shares that dictionary (the known
    limits); else it is nothing of the fix's (a direct call of the library's hook function)."""
    off_keys = [key for key, hook in module._forward_hooks.items() if _is_fixed_off_hook(hook)]
    if not off_keys:
        return
    _record(module, _uncoverable)
    always = module._forward_hooks_always_called
    if any(each._forward_hooks_always_called is always for each in _alive(_covered)):
        return
    for key in off_keys:
        always.pop(key, None)


def _collected(key: int, record: dict[int, weakref.ref[Any]]) -> None:
    ledger.module_collected(key)  # before its entry goes: a fork in between leaves nothing unrecorded
    record.pop(key, None)


def covered_ids() -> dict[int, weakref.ref[Any]]:
    """The record of covered modules itself, for the pre-hook to look a module up in (a dictionary lookup,
    no call)."""
    return _covered


def covered_module(key: int) -> Any:
    """The covered module of that ``id`` (None: none alive)."""
    ref = _covered.get(key)
    return None if ref is None else ref()


def is_uncoverable(module: Any) -> bool:
    return id(module) in _uncoverable


def _alive(record: dict[int, weakref.ref[Any]]) -> list[Any]:
    modules = (ref() for ref in list(record.values()))
    return [module for module in modules if module is not None]


def _fixed_pairs_of(library_name: str) -> list[tuple[FunctionType, FunctionType]]:
    return [pair for pair, name in FIXED_PAIRS.items() if name == library_name]


def number_covered(library_name: str) -> int:
    """How many covered modules hold one of the library's fixed pre-hooks (never one it cannot cover)."""
    pre_hooks = [pre_hook for pre_hook, _ in _fixed_pairs_of(library_name)]
    return _holding(_alive(_covered), "_forward_pre_hooks", pre_hooks)


def number_uncoverable(library_name: str) -> int:
    """How many modules alive the fix could not cover hold one of the library's fixed off hooks."""
    off_hooks = [off_hook for _, off_hook in _fixed_pairs_of(library_name)]
    return _holding(_alive(_uncoverable), "_forward_hooks", off_hooks)


def _holding(modules: list[Any], dictionary: str, hooks: list[FunctionType]) -> int:
    """How many of ``modules`` hold one of ``hooks`` in their hook dictionary of that name."""
    held = [getattr(module, dictionary, {}).values() for module in modules]
    return sum(any(hook is each for hook in values for each in hooks) for values in held)


def number_awaiting(modules: list[Any]) -> int:
    """How many of ``modules`` (those quantized before the fix turned on late) are neither covered nor
    found uncoverable yet: the fix covers each at its next forward."""
    return sum(id(module) not in _covered and id(module) not in _uncoverable for module in modules)


def off_hooks_all_plain(module: Any) -> bool:
    """Whether none of the module's fixed off hooks is marked always called (a deep copy of a covered
    module keeps its mark)."""
    always = getattr(module, "_forward_hooks_always_called", {})
    hooks = getattr(module, "_forward_hooks", {})
    return not any(key in always for key, hook in hooks.items() if _is_fixed_off_hook(hook))
