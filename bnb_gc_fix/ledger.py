"""What the fix's forwards switched on and have not switched off yet, thread by thread. Imports no torch.

A *switch-on* is one count on torch's counter, added by a covered module's forward pre-hook for that module
on its thread (``bnb_gc_fix.hooks``). The module's forward hook, which torch calls even when the forward
raises, takes it off again. torch calls no forward hook when a ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) leaves a forward: such a switch-on
stays in its thread's record until the module is entered again on that thread, a notebook cell that made
it ends, its thread ends, the module is collected, or ``bnb_gc_fix.reset()``.

A thread's record holds one entry per module at most (a module entered again switches its earlier
switch-on off first), and an entry goes when its forward ends: between steps the records are usually
empty, whatever the number of modules or threads ever seen.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref

from bnb_gc_fix import cache

#: Each switch-on's ticket: a later one has a larger one (a notebook cell switches off those after its own).
tickets = itertools.count(1)


class SwitchOns(dict[int, int]):
    """One thread's switch-ons not switched off yet: for each module (by ``id``), the ticket of its
    switch-on. Between steps it is usually empty, which keeps torch.compile's guards on it unchanged."""

    def switch_off_all(self) -> None:
        cache.switch_off(cache.parametrize(), len(self))
        self.clear()

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


def module_collected(key: int) -> None:
    """A covered module (by ``id``) is gone: switch off every thread's switch-on for it."""
    for switch_ons in list(_threads.values()):
        if switch_ons.pop(key, None) is not None:
            cache.switch_off(cache.parametrize(), 1)


def switch_off_since(ticket: int) -> int:
    """Switch off this thread's switch-ons made after ``ticket`` (a notebook cell's own); returns how many."""
    switch_ons = local.switch_ons
    mine = [key for key, taken in list(switch_ons.items()) if taken > ticket]
    cache.switch_off(cache.parametrize(), len(mine))
    for key in mine:
        del switch_ons[key]
    return len(mine)


def count_every_thread() -> int:
    """How many of the counter's switch-ons are the fix's forwards', on every thread."""
    return sum(len(switch_ons) for switch_ons in list(_threads.values()))


def forget_every_thread() -> None:
    """Every thread forgets its switch-ons, switching nothing off (the counter was reset)."""
    for switch_ons in list(_threads.values()):
        switch_ons.clear()


def reset() -> int:
    """``bnb_gc_fix.reset()``: switch torch's parametrization cache off, whoever switched it on. The counter
    goes to 0, the cache is emptied, and the fix forgets what its forwards had switched on. Returns the
    counter as it stood (0 while torch's parametrize module is not imported). Never imports torch. Inside
    an open ``P.cached()`` block the counter ends at -1 when the block does: call it once no forward runs
    and no such block is open."""
    parametrize = cache.parametrize()
    if parametrize is None:
        return 0
    forget_every_thread()
    before = max(cache.counter(), 0)
    parametrize._cache_enabled = 0
    parametrize._cache = {}
    return before
