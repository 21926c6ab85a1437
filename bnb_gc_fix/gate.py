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


class ThreadHolds(dict[int, int]):
    """One thread's holds: for each module it holds (by ``id``), the ticket of its hold. There is one at
    most, since a module entered again gives its earlier hold back first; between steps the holds are
    usually none, which keeps torch.compile's guards on them unchanged."""

    def __del__(self) -> None:  # its thread ended; in a forked child, every thread but the one that forked
        try:
            _give_back(len(self))
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


def _never_compiling() -> bool:  # a torch without torch.compiler.is_dynamo_compiling (before 2.3)
    return False


#: True while Dynamo traces the caller (it reads it as a constant), False when the code runs.
_compiling = getattr(torch.compiler, "is_dynamo_compiling", _never_compiling)


# --- the hooks -------------------------------------------------------------------------------------------
# Neither names the thread's holds in a local variable: a forked child keeps the frames of its parent's
# other threads, and such a name would keep their holds from being given back there.
def enter(module: torch.nn.Module) -> None:
    """The pre-hook: take the module over if that is still to do, then take one hold for it. A hold taken
    in a torch.compile trace has ticket 0 (Dynamo would compile anew for each ticket): no safety net's span
    holds it, and the module's next forward gives it back."""
    key = id(module)
    if key not in _taken_over:
        taken = take_over(module)
        if not taken:
            P._cache_enabled += 1  # as the library's own hook does; leave() gives it back the same way
            return
    if key in _local.holds:  # entered again on this thread: its last call ended by Ctrl-C, or calls itself
        _give_back(1)  # (a call of itself then reads its weights again: more dequantization, never a leak)
    P._cache_enabled += 1
    _local.holds[key] = 0 if _compiling() else next(tickets)


def leave(module: torch.nn.Module) -> None:
    """The forward hook: give back this thread's hold for the module."""
    key = id(module)
    if key not in _local.holds:
        _leave_without_hold(module)
        return
    _give_back(1)
    del _local.holds[key]


def _give_back(count: int) -> None:
    """Take ``count`` holds off torch's counter, never below 0; the cache is emptied at 0. Called before
    the holds are forgotten: a fork in between leaves the child a hold too many, which it gives back
    clamped, never one too few."""
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}


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
    """A module taken over is gone: give back every thread's hold for it."""
    _taken_over.pop(key, None)
    for holds in list(_EVERY_THREAD.values()):
        if holds.pop(key, None) is not None:
            _give_back(1)


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
    mine = [key for key, taken in list(_local.holds.items()) if taken > ticket]
    _give_back(len(mine))
    for key in mine:
        del _local.holds[key]
    return len(mine)


def held_by_every_thread() -> int:
    """How many holds the fix's hooks keep, on every thread."""
    return sum(len(holds) for holds in list(_EVERY_THREAD.values()))


def forget_every_hold() -> None:
    """Every thread forgets its holds, giving nothing back (the counter was reset, or the fix is leaving)."""
    for holds in list(_EVERY_THREAD.values()):
        holds.clear()


def reset() -> int:
    """Counter to 0 and the cache emptied, whoever holds it, every hold forgotten; returns the holds."""
    forget_every_hold()
    return cache.release_all()


# --- the code the libraries' hook functions get (patch.py) ------------------------------------------------
# Each calls the function above through a default argument: the code runs with the library's module as its
# globals, so it must name no global at all (tests/test_gate.py checks that).
def enable_code(module: Any, inputs: Any, _enter: Any = enter) -> None:
    _enter(module)


def disable_code(module: Any, inputs: Any, output: Any, _leave: Any = leave) -> None:
    _leave(module)
