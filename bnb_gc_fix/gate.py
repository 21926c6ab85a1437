"""What a library's two hook functions do once the fix is on: exact holds on torch's parametrization cache.

A *hold* is one count on torch's counter (``P._cache_enabled``; the cache is on while it is not 0),
taken by a module's forward pre-hook (:func:`enable_code`) for that module on its thread. The module's
forward hook (:func:`disable_code`), which torch calls even when the forward raises, gives it back, and the
cache is emptied when the counter reaches 0. torch calls no forward hook when a ``BaseException`` that is
not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) leaves a forward: such a
hold is given back when the module is entered again on its thread, when a safety net's span that took it
ends, when its thread ends, when the module is collected, or by ``bnb_gc_fix.reset()``.

Before its first hold a module is *taken over* (:func:`take_over`): the pairs its library registered,
one per quantized parameter, become one pair whose forward hook torch calls always.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import torch
import torch.nn.utils.parametrize as P

from bnb_gc_fix import census, lock

#: Each hold's ticket: a hold taken later has a larger one (a safety net gives back those after its own).
tickets = itertools.count(1)

#: The libraries' hook functions the fix has given its code, as (enable, disable) pairs (patch.py).
PAIRS: list[tuple[FunctionType, FunctionType]] = []


class ThreadHolds(dict[int, int]):
    """One thread's holds: for each module it holds (by ``id``), the ticket of its hold. There is one at
    most, since a module entered again gives its earlier hold back first; between steps the holds are
    usually none, which keeps torch.compile's guards on them unchanged."""

    def give_back_all(self) -> None:
        count = len(self)
        give_back(count)
        self.clear()

    def __del__(self) -> None:  # its thread ended: a thread that holds nothing touches nothing
        if not self:
            return
        try:
            self.give_back_all()
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
#: The modules let go when the fix last left: each is taken over again at its next forward with the fix on.
_let_go: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
#: By ``id``, the modules whose collection gives back their holds (one finalizer each, however often taken
#: over); an entry goes when its module is collected.
_watched: set[int] = set()
#: The keys (torch's handle ids, unique in a process) of the off hooks the fix marked always called. A
#: deep copy or a pickle keeps a module's keys, so this marks the fix's own wherever the module went.
_marked_keys: set[int] = set()


def _in_a_forked_child() -> None:
    """The parent's other threads are gone: give their holds back."""
    mine = _local.holds
    for holds in list(_EVERY_THREAD.values()):
        if holds is not mine:
            holds.give_back_all()


if hasattr(os, "register_at_fork"):  # not on Windows, which never forks
    os.register_at_fork(after_in_child=_in_a_forked_child)


def _never_compiling() -> bool:  # a torch without torch.compiler.is_dynamo_compiling (before 2.3)
    return False


#: True while Dynamo traces the caller (it reads it as a constant), False when the code runs.
_compiling = getattr(torch.compiler, "is_dynamo_compiling", _never_compiling)


# --- giving back ---------------------------------------------------------------------------------------
def give_back(count: int) -> None:
    """Take ``count`` holds off torch's counter, never below 0; the cache is emptied at 0. With nothing to
    give back, torch's counter is neither read nor written."""
    if count <= 0:
        return
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}


def leave_without_hold(module: torch.nn.Module) -> None:
    """No hold to give back: none was taken (an earlier pre-hook raised), it was given back early, or the
    forward began before the fix turned on. Only in that last case is the module's off hook still plain
    (torch calls a plain one only after the forward and its pre-hooks ran), and the library's +1 is given
    back, as it is for a direct call on something that holds no off hook of the library at all."""
    always = getattr(module, "_forward_hooks_always_called", {})
    hooks = getattr(module, "_forward_hooks", {})
    ours = [key for key, hook in hooks.items() if _is_disable(hook)]
    if not ours or ours[-1] not in always:
        give_back(1)


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
        with lock.held():
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
    if not disables:
        handle = module.register_forward_hook(_disable_of(pre_hooks[enables[0]]), always_call=True)
        _marked_keys.add(handle.id)
    elif disables[-1] not in always:
        always[disables[-1]] = True
        _marked_keys.add(disables[-1])
    key = id(module)
    _taken_over[key] = weakref.ref(module)
    if key not in _watched:
        _watched.add(key)
        collected = weakref.finalize(module, _collected, key)
        collected.atexit = False  # nothing for a module alive at exit, or collected as the interpreter ends
    return True


def _collected(key: int) -> None:
    """A module taken over is gone: give back every thread's hold for it."""
    _taken_over.pop(key, None)
    _watched.discard(key)
    for holds in list(_EVERY_THREAD.values()):
        if holds.pop(key, None) is not None:
            give_back(1)


def holds_a_pair(module: torch.nn.Module) -> bool:
    """Whether one of the module's pre-hooks is a hook function the fix gave its code."""
    return any(_is_enable(hook) for hook in module._forward_pre_hooks.values())


def is_taken_over(module: torch.nn.Module) -> bool:
    return id(module) in _taken_over


def covered() -> list[torch.nn.Module]:
    """The modules taken over that are alive, and those let go, which are taken over again at their next
    forward while the fix is on."""
    modules = (ref() for ref in list(_taken_over.values()))
    taken = [module for module in modules if module is not None]
    return taken + [module for module in list(_let_go) if id(module) not in _taken_over]


def number_holding(enable: object) -> int:
    """How many of the modules taken over hold ``enable`` (a library's hook function) as a pre-hook."""
    return sum(any(hook is enable for hook in m._forward_pre_hooks.values()) for m in covered())


def let_every_module_go() -> None:
    """The fix is leaving: every module alive in this process whose off hook the fix marked always called
    (those taken over, their deep copies, modules loaded from a pickle of one) gets it back as its library
    registered it. Every module and every hold is then forgotten; with the fix on again, a module's next
    forward takes it over anew. Never raises: an object it cannot read is left as it is."""
    off_hooks = [disable for _, disable in PAIRS]
    for module, hooks in census.modules_holding(off_hooks, census.HOOKS):
        always = vars(module).get("_forward_hooks_always_called")
        # What cannot be read is left as it is: an always-called dictionary that is not torch's, or a
        # module that cannot be hashed (the weak set hashes it).
        with contextlib.suppress(Exception):
            for key in hooks:
                if key in _marked_keys:
                    always.pop(key, None)
            _let_go.add(module)
    _taken_over.clear()
    forget_every_hold()


# --- for the safety nets, status and reset --------------------------------------------------------------
def give_back_since(ticket: int) -> int:
    """Give back this thread's holds taken after ``ticket`` (a safety net's own); returns how many."""
    mine = [key for key, taken in list(_local.holds.items()) if taken > ticket]
    give_back(len(mine))
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


# --- the hooks: the code the libraries' two hook functions get (patch.py) ---------------------------------
# They run with the library's module as their globals (the functions keep their identity; only their code
# changes), so every name they use comes through a default argument, bound here: tests/test_gate.py checks
# that they load no global. A thread's holds never count fewer than its share of the counter: a hold is
# noted before the counter is raised and forgotten after it is lowered, so a fork in between leaves the
# child a hold to give back (clamped at 0), never a count it cannot.


def enable_code(
    module: Any,
    inputs: Any,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _local: _Local = _local,
    _taken_over: dict[int, weakref.ref[torch.nn.Module]] = _taken_over,
    _tickets: Iterator[int] = tickets,
    _compiling: Callable[[], bool] = _compiling,
    _gate: Any = sys.modules[__name__],
) -> None:
    """The pre-hook: take one hold for the module on this thread, taking the module over first if that is
    still to do. A hold taken in a torch.compile trace has ticket 0 (Dynamo would compile anew for each
    ticket): no safety net's span holds it, and the module's next forward gives it back."""
    key = id(module)
    if key not in _taken_over:
        taken = _gate.take_over(module)
        if not taken:
            _P._cache_enabled += 1  # as the library's own hook does; the off hook gives it back the same way
            return
    holds = _local.holds
    if key in holds:  # entered again on this thread: its last call left by Ctrl-C, or it calls itself
        _gate.give_back(1)  # (a call of itself then reads its weights again: never a leak)
    holds[key] = 0 if _compiling() else next(_tickets)
    _P._cache_enabled += 1


def disable_code(
    module: Any,
    inputs: Any,
    output: Any,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _local: _Local = _local,
    _gate: Any = sys.modules[__name__],
) -> None:
    """The forward hook, always called: give back this thread's hold for the module (give_back(1) written
    out: this is the hot path)."""
    key = id(module)
    holds = _local.holds
    if key not in holds:
        _gate.leave_without_hold(module)
        return
    remaining = _P._cache_enabled - 1
    if remaining > 0:
        _P._cache_enabled = remaining
    else:
        _P._cache_enabled = 0
        _P._cache = {}
    holds.pop(key, None)  # reset() or deactivate() on another thread may have forgotten it meanwhile
