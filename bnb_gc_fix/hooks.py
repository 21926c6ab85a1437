"""Finding the plain cache pairs on a module, and putting a gate in their place.

A plain pair is a forward pre-hook that switches torch's parametrization cache on and a forward hook
that switches it off, registered by bitsandbytes or by a copy of its code (axolotl's). They are known
by their functions' names (``_bnb_gc_fix.ENABLE_HOOK`` and ``DISABLE_HOOK``), wrapped or not. The
gate's hooks (:mod:`bnb_gc_fix.gate`) take the places of the first enable hook and the last disable
hook, so every other hook runs in the order it did, and the others of the pairs are dropped.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

import _bnb_gc_fix as words
from bnb_gc_fix import gate

#: Held while a module's hooks are edited: two threads converting one module at its first forward (or
#: repair() beside a forward) never edit its dictionaries at once.
lock = threading.RLock()


def _renew_lock() -> None:
    """A forked child never waits on a lock that one of its parent's other threads held."""
    global lock
    lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


def _is_gate_hook(hook: object) -> bool:
    return isinstance(hook, (gate.EnterHook, gate.LeaveHook))


def _named(hook: object, name: str) -> bool:
    """Whether ``hook`` is a function called ``name`` (or a wrapt wrapper of one), not a gate's."""
    return getattr(hook, "__name__", None) == name and not _is_gate_hook(hook)


@dataclass(frozen=True)
class CacheHooks:
    """The cache pairs' hooks on one module (bitsandbytes' or a copy's, not a gate's): their keys in its
    hook dictionaries, in order."""

    enable_keys: list[int]
    disable_keys: list[int]
    always_called: bool  # there are disable hooks, and every one runs even when the forward raises

    @property
    def upstream_fixed(self) -> bool:
        """Every enable hook has an always-called disable hook: bitsandbytes 0.50's pair."""
        return self.always_called and len(self.disable_keys) == len(self.enable_keys)


def cache_hooks(module: torch.nn.Module) -> CacheHooks:
    """The module's enable pre-hooks and disable forward hooks that are not a gate's."""
    enables = [key for key, hook in module._forward_pre_hooks.items() if _named(hook, words.ENABLE_HOOK)]
    disables = [key for key, hook in module._forward_hooks.items() if _named(hook, words.DISABLE_HOOK)]
    always = module._forward_hooks_always_called
    always_called = bool(disables) and all(key in always for key in disables)
    return CacheHooks(enable_keys=enables, disable_keys=disables, always_called=always_called)


def _take_place(hooks: dict[int, Any], keys: list[int], hook: object, first: bool) -> int:
    """Put ``hook`` where the first (or the last) of ``keys`` is in ``hooks``, drop the others of
    ``keys``, and return the key kept."""
    in_order = [key for key in hooks if key in keys]
    kept = in_order[0] if first else in_order[-1]
    for key in in_order:
        if key != kept:
            del hooks[key]
    hooks[kept] = hook  # assigning to an existing key keeps its place
    return kept


def _reference(function: object) -> str:
    """``"module:qualified name"`` of a hook function, for ``pkgutil.resolve_name``."""
    return f"{getattr(function, '__module__', '')}:{getattr(function, '__qualname__', '')}"


def gate_hooks(module: torch.nn.Module) -> tuple[gate.EnterHook, gate.LeaveHook] | None:
    """The module's gate's two hooks, if it has a gate."""
    enter = gate.enter_hook(module)
    if enter is None:
        return None
    for hook in module._forward_hooks.values():
        if isinstance(hook, gate.LeaveHook) and hook.gate is enter.gate:
            return enter, hook
    return None


def _new_hooks(module: torch.nn.Module, found: CacheHooks) -> tuple[gate.EnterHook, gate.LeaveHook]:
    """A new gate's hooks, standing in for the first enable function and the last disable function
    found (an enable hook alone: the disable function of the enable function's module)."""
    enable = module._forward_pre_hooks[found.enable_keys[0]]
    if found.disable_keys:
        disable = _reference(module._forward_hooks[found.disable_keys[-1]])
    else:
        disable = f"{getattr(enable, '__module__', '')}:{words.DISABLE_HOOK}"
    return gate.new_hooks(_reference(enable), disable)


def _put_enter_hook(module: torch.nn.Module, enables: list[int], enter: gate.EnterHook) -> None:
    """The gate's pre-hook where the first enable hook (or an earlier gate's pre-hook) was."""
    pre_hooks = module._forward_pre_hooks
    gates = [key for key, hook in pre_hooks.items() if _is_gate_hook(hook)]
    _take_place(pre_hooks, gates + enables, enter, first=True)
    for key in enables + gates:
        module._forward_pre_hooks_with_kwargs.pop(key, None)


def _put_leave_hook(module: torch.nn.Module, disables: list[int], leave: gate.LeaveHook) -> None:
    """The gate's forward hook, always called, where the last disable hook (or an earlier gate's
    forward hook) was; registered anew where there was none. torch's always-called dictionary stays
    the module's own: its entries are edited in place, and the hook itself carries what a pickle needs
    to load the pair as it was."""
    post_hooks = module._forward_hooks
    always = module._forward_hooks_always_called
    gates = [key for key, hook in post_hooks.items() if _is_gate_hook(hook)]
    replaces_plain = leave.plain_key is not None or any(key not in always for key in disables)
    if disables or gates:
        kept = _take_place(post_hooks, gates + disables, leave, first=False)
    else:  # an enable hook alone: the gate still needs its forward hook
        kept = module.register_forward_hook(leave).id
    for key in disables + gates:
        module._forward_hooks_with_kwargs.pop(key, None)
        always.pop(key, None)
    always[kept] = True
    leave.always_called = always
    leave.plain_key = kept if replaces_plain else None


def install(module: torch.nn.Module, replace_always_called: bool = False) -> bool:
    """Replace every plain cache pair on ``module`` with its one gate, in the pairs' places (an enable
    hook without a disable hook too: the gate then registers its own forward hook).

    Returns whether the module changed. A module without an enable hook is left alone, and so is one
    whose pairs are right (bitsandbytes 0.50) unless ``replace_always_called`` (``BNB_GC_FIX=force``).
    """
    with lock:
        found = cache_hooks(module)
        if not found.enable_keys:
            return False
        if found.upstream_fixed and not replace_always_called:
            return False
        pair = gate_hooks(module)
        if pair is None:
            pair = _new_hooks(module, found)
        enter, leave = pair
        _put_enter_hook(module, found.enable_keys, enter)
        _put_leave_hook(module, found.disable_keys, leave)
        return True
