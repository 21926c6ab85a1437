"""What the fix's forwards switched on and have not switched off yet, thread by thread. Imports no torch.

A *switch-on* is one count on torch's counter, added by a covered module's forward pre-hook for that module
on its thread (``bnb_gc_fix.hooks``). The module's forward hook, which torch calls even when the forward
raises, takes it off again. torch calls no forward hook when a ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) leaves a forward: such a switch-on
stays in its thread's record until the module is entered again on that thread, a notebook cell that made
it ends, its thread ends, the module is collected, or ``bnb_gc_fix.reset()``.

A thread's record holds one entry per covered module at most, and an entry goes when its forward ends:
between steps the records are usually empty, whatever the number of modules or threads ever seen. A module
that calls itself inside its forward keeps its one switch-on for the inner calls: while one runs, the
module's entry is :data:`NESTED`, and the outer calls' entries wait in ``outer``.

Every change keeps one order: an entry is made before the counter is raised, and dropped after it is
lowered, so a fork in between leaves the child one entry too many (switched off clamped at 0), never a
count that nobody switches off.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from bnb_gc_fix import cache, census

#: Each switch-on's ticket: a later one has a larger one (a notebook cell switches off those after its own).
tickets = itertools.count(1)
#: The ticket of a switch-on made inside a torch.compile trace (Dynamo would compile anew for each ticket):
#: never later than a cell's, so no cell's end switches it off; the module's next forward does.
COMPILED = -1
#: A module's entry while a call of it inside its own forward runs: the switch-on is the outer call's.
#: The only entry that is false: the off hook's one test, ``if not switch_ons.get(key)``, finds it so.
NESTED = 0


class SwitchOns(dict[int, int]):
    """One thread's switch-ons not switched off yet: for each covered module (by ``id``), the ticket of its
    one switch-on, or :data:`NESTED`; in ``outer``, for a module calling itself, the entries of its outer
    calls, outermost first (the first is the switch-on's ticket). Between steps both are usually empty,
    which keeps torch.compile's guards on the dictionary unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.outer: dict[int, list[int]] = {}

    def ticket(self, key: int) -> int:
        """The ticket of the module's switch-on (by ``id``), whose entry is here."""
        waiting = self.outer.get(key)
        return waiting[0] if waiting else self[key]

    def nest(self, key: int) -> None:
        """A call of the module (by ``id``) inside its own forward begins: it keeps the switch-on."""
        self.outer.setdefault(key, []).append(self[key])
        self[key] = NESTED

    def unnest(self, key: int) -> bool:
        """A call nested in another of the module (by ``id``) ends: the call it ran in has the entry back.
        Returns whether one did."""
        waiting = self.outer.get(key)
        if not waiting:
            return False
        self[key] = waiting.pop()
        if not waiting:
            del self.outer[key]
        return True

    def switch_off_module(self, key: int) -> None:
        """Switch off the module's switch-on (by ``id``), if it has one here, and drop its entries."""
        cache.switch_off(cache.parametrize(), int(key in self))
        self.pop(key, None)
        self.outer.pop(key, None)

    def switch_off_all(self) -> None:
        cache.switch_off(cache.parametrize(), len(self))
        self.clear()
        self.outer.clear()

    def __del__(self) -> None:  # its thread ended: a thread that switched nothing on touches nothing
        if not self:
            return
        try:
            self.switch_off_all()
        except Exception:  # at interpreter shutdown, with modules half torn down
            pass


class _Local(threading.local):
    def __init__(self) -> None:  # once in each thread, at its first use
        self.switch_ons = SwitchOns()
        _threads[id(self.switch_ons)] = self.switch_ons


#: Every live thread's record (an entry goes with its thread).
_threads: weakref.WeakValueDictionary[int, SwitchOns] = weakref.WeakValueDictionary()
#: This thread's record is ``local.switch_ons``.
local = _Local()


def _in_a_forked_child() -> None:
    """The parent's other threads are gone: switch theirs off."""
    mine = local.switch_ons
    for switch_ons in list(_threads.values()):
        if switch_ons is not mine:
            switch_ons.switch_off_all()


if hasattr(os, "register_at_fork"):  # not on Windows, which never forks
    os.register_at_fork(after_in_child=_in_a_forked_child)


def _module_call_code() -> Any:
    """The code of torch's ``Module._call_impl``: its frames are modules' calls (None: no torch.nn)."""
    return getattr(getattr(census.module_class(), "_call_impl", None), "__code__", None)


def _a_call_from(frame: FrameType | None, module: Any, call: Any) -> bool:
    """Whether a frame from ``frame`` outwards is a call of ``module``: of ``call``, its self ``module``."""
    while frame is not None:
        if frame.f_code is call and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def call_running(module: Any) -> bool:
    """Whether a call of ``module`` runs on this thread now (a read of the thread's stack)."""
    return _a_call_from(sys._getframe(1), module, _module_call_code())


def outer_call_running(module: Any) -> bool:
    """Whether a call of ``module`` runs on this thread further out than the innermost module call, the
    one whose hook asks (its self is not read): the module calls itself. A read of the thread's stack."""
    call = _module_call_code()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not call:  # up to the call whose hook asks
        frame = frame.f_back
    return frame is not None and _a_call_from(frame.f_back, module, call)


def module_collected(key: int) -> None:
    """A module the fix covered (by ``id``) is gone: switch off every thread's switch-on for it."""
    for switch_ons in list(_threads.values()):
        switch_ons.switch_off_module(key)


def switch_off_since(ticket: int) -> int:
    """Switch off this thread's switch-ons made after ``ticket`` (a notebook cell's own); returns how many."""
    switch_ons = local.switch_ons
    later = [key for key in list(switch_ons) if switch_ons.ticket(key) > ticket]
    for key in later:
        switch_ons.switch_off_module(key)
    return len(later)


def count_every_thread() -> int:
    """How many of the counter's switch-ons are the fix's own forwards', on every thread."""
    return sum(len(switch_ons) for switch_ons in list(_threads.values()))


def left_here(module_of: Callable[[int], Any]) -> int:
    """How many of this thread's switch-ons belong to no call running on it: a ``BaseException`` that is
    not an ``Exception`` left them (``module_of``: the covered module of an ``id``)."""
    keys = list(local.switch_ons)
    return sum(not call_running(module_of(key)) for key in keys)


def forget_every_thread() -> None:
    """Every thread forgets its switch-ons, switching nothing off (the counter was reset)."""
    for switch_ons in list(_threads.values()):
        switch_ons.clear()
        switch_ons.outer.clear()


def reset() -> int:
    """``bnb_gc_fix.reset()``: switch torch's parametrization cache off, whoever switched it on. The counter
    goes to 0, the cache is emptied, and the fix forgets what its forwards had switched on. Returns the
    counter as it stood (0 while torch's parametrize module is not imported). Never imports torch. Inside
    an open ``P.cached()`` block the counter ends at -1 when the block does: call it once no forward runs
    and no such block is open."""
    parametrize = cache.parametrize()
    if parametrize is None:
        return 0
    before = max(cache.counter(), 0)
    parametrize._cache_enabled = 0
    parametrize._cache = {}
    forget_every_thread()  # after the counter went to 0, as every change of the record (the docstring)
    return before
