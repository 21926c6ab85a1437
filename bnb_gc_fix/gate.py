"""What a library's two hook functions do once the fix is on: exact holds on torch's parametrization cache.

A *hold* is one count on torch's counter (``P._cache_enabled``; the cache is on while it is above 0),
taken by a module's forward pre-hook (:func:`enter`) for that module on its thread. The module's forward
hook (:func:`leave`), which torch calls even when the forward raises, gives it back, and the cache is
emptied when the counter reaches 0. torch calls no hook when a ``BaseException`` (Ctrl-C) leaves a
forward: such a hold is given back when the module is entered again on its thread, when a safety net's
span that took it ends, when its thread ends, when the module is collected, or by :func:`reset`.

Before its first hold a module is *taken over* (:func:`take_over`): the pairs its library registered,
one per quantized parameter, become one pair whose forward hook torch calls always.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from types import FunctionType
from typing import Any

import torch
import torch.nn.utils.parametrize as P

from bnb_gc_fix import cache

#: Each hold's ticket: a hold taken later has a larger one (a safety net gives back those after its own).
tickets = itertools.count(1)

#: The libraries' hook functions the fix has given its code, as (enable, disable) pairs (patch.py).
PAIRS: list[tuple[FunctionType, FunctionType]] = []


class ThreadHolds(dict[int, list[int]]):
    """One thread's holds: for each module (by ``id``), the tickets of its holds, the oldest first."""

    def count(self) -> int:
        return sum(len(held) for held in list(self.values()))  # a copy: _collected() may pop meanwhile

    def __del__(self) -> None:  # its thread ended; in a forked child, every thread but the one that forked
        try:
            _give_back(self.count())
        except Exception:  # at interpreter shutdown, with modules half torn down
            pass


class _Local(threading.local):
    def __init__(self) -> None:  # once in each thread, at its first use
        self.holds = ThreadHolds()
        _EVERY_THREAD[id(self.holds)] = self.holds


_EVERY_THREAD: weakref.WeakValueDictionary[int, ThreadHolds] = weakref.WeakValueDictionary()
_local = _Local()

#: The modules taken over, by ``id``; an entry goes when its module is collected.
_taken_over: dict[int, weakref.ref[torch.nn.Module]] = {}
_lock = threading.Lock()  # held while a module is taken over


def _renew_lock() -> None:  # a forked child never waits on a lock another thread of its parent held
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which never forks
    os.register_at_fork(after_in_child=_renew_lock)


# --- the hooks -------------------------------------------------------------------------------------------
def enter(module: torch.nn.Module) -> None:
    """The pre-hook: take the module over if that is still to do, then take one hold for it."""
    key = id(module)
    if key not in _taken_over:
        taken = take_over(module)
        if not taken:
            P._cache_enabled += 1  # as the library's own hook does; leave() gives it back the same way
            return
    held = _local.holds.get(key)  # no name for the thread's holds: a forked child must be able to drop them
    if held is None:
        held = _local.holds.setdefault(key, [])
    elif held:  # entered again on this thread: its earlier call ended by Ctrl-C, or is calling itself
        _give_back_all(held)
    P._cache_enabled += 1
    held.append(next(tickets))


def leave(module: torch.nn.Module) -> None:
    """The forward hook: give back this thread's latest hold for the module."""
    held = _local.holds.get(id(module))
    if not held:
        _leave_without_hold(module)
        return
    _give_back(1)
    held.pop()


def _give_back(count: int) -> None:
    """Take ``count`` holds off torch's counter, never below 0; the cache is emptied at 0. Called before
    the holds are dropped from their list: a fork in between leaves the child a hold too many, which it
    gives back clamped, never one too few."""
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}


def _give_back_all(held: list[int]) -> None:
    """Give back every hold of this thread for one module. In a module that calls itself, the inner call
    gives back the outer one's, which then reads its weights again (more dequantization, never a leak)."""
    _give_back(len(held))
    held.clear()


def _leave_without_hold(module: torch.nn.Module) -> None:
    """No hold to give back: none was taken (an earlier pre-hook raised), it was given back early, or the
    forward began before the fix turned on. Only in that last case is the module's off hook still plain
    (torch calls a plain one only after the forward and its pre-hooks ran), and the library's +1 is given
    back, as it is for a direct call on something that holds no off hook of the library at all."""
    always = getattr(module, "_forward_hooks_always_called", {})
    hooks = getattr(module, "_forward_hooks", {})
    ours = [key for key, hook in hooks.items() if _is_disable(hook)]
    if not ours or ours[-1] not in always:
        _give_back(1)


# --- taking a module over ------------------------------------------------------------------------------
def _is_enable(hook: object) -> bool:
    return any(hook is enable for enable, _ in PAIRS)


def _is_disable(hook: object) -> bool:
    return any(hook is disable for _, disable in PAIRS)


def _disable_of(enable: object) -> FunctionType:
    return next(disable for each, disable in PAIRS if each is enable)


def take_over(module: torch.nn.Module) -> bool:
    """Make the module hold one pair of the libraries' hook functions, its off hook always called, in the
    places of the first enable and the last disable hook (every other hook keeps its place); returns
    whether it holds such a pair now. Never raises."""
    try:
        with _lock:
            return _fold(module)
    except Exception:  # hook dictionaries that do not look as torch's: the library's own behaviour
        return False


def _fold(module: torch.nn.Module) -> bool:
    pre_hooks = module._forward_pre_hooks
    enables = [key for key, hook in pre_hooks.items() if _is_enable(hook)]
    if not enables:
        return False
    post_hooks = module._forward_hooks
    always = module._forward_hooks_always_called
    disables = [key for key, hook in post_hooks.items() if _is_disable(hook)]
    for key in enables[1:]:
        del pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in disables[:-1]:
        del post_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        always.pop(key, None)
    if disables:
        always[disables[-1]] = True
    else:
        module.register_forward_hook(_disable_of(pre_hooks[enables[0]]), always_call=True)
    key = id(module)
    _taken_over[key] = weakref.ref(module, lambda _, key=key: _collected(key))  # type: ignore[misc]
    return True


def _collected(key: int) -> None:
    """A module taken over is gone: give back every thread's holds for it."""
    _taken_over.pop(key, None)
    for holds in list(_EVERY_THREAD.values()):
        _give_back_all(holds.pop(key, []))


def holds_a_pair(module: torch.nn.Module) -> bool:
    """Whether one of the module's pre-hooks is a hook function the fix gave its code."""
    return any(_is_enable(hook) for hook in module._forward_pre_hooks.values())


def is_taken_over(module: torch.nn.Module) -> bool:
    return id(module) in _taken_over


def covered() -> list[torch.nn.Module]:
    """The modules taken over that are alive."""
    modules = (ref() for ref in list(_taken_over.values()))
    return [module for module in modules if module is not None]


# --- for the safety nets, repair and reset --------------------------------------------------------------
def give_back_since(ticket: int) -> int:
    """Give back this thread's holds taken after ``ticket`` (a safety net's own); returns how many."""
    lists = list(_local.holds.values())
    given = sum(sum(taken > ticket for taken in held) for held in lists)
    _give_back(given)
    for held in lists:
        while held and held[-1] > ticket:
            held.pop()
    return given


def held_by_every_thread() -> int:
    """How many holds the hooks of the fix keep, on every thread."""
    return sum(holds.count() for holds in list(_EVERY_THREAD.values()))


def forget_every_hold() -> None:
    """Every thread forgets its holds, giving nothing back (the counter was reset, or the fix is leaving)."""
    for holds in list(_EVERY_THREAD.values()):
        holds.clear()


def reset() -> int:
    """Counter to 0 and the cache emptied, whoever holds it, every hold forgotten; returns the holds."""
    forget_every_hold()
    return cache.release_all()


# --- the code the libraries' hook functions get (patch.py) ------------------------------------------------
# Each calls the function above through a default argument: the code runs with the library's module as
# its globals, so it must name no global at all (tests/test_gate.py checks that).
def enable_code(module: Any, inputs: Any, _enter: Any = enter) -> None:
    _enter(module)


def disable_code(module: Any, inputs: Any, output: Any, _leave: Any = leave) -> None:
    _leave(module)
