"""What the fix's forwards switched on and have not switched off yet, thread by thread. Imports no torch.

A *switch-on* is one count on torch's counter, added by a covered module's forward pre-hook for that module
on its thread (``bnb_gc_fix.hooks``). The module's forward hook, which torch calls even when the forward
raises, takes it off again. torch calls no forward hook when a ``BaseException`` that is not an
``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) leaves a forward: such a switch-on
stays in its thread's record until the module is entered again on that thread, a notebook cell that made
it ends, its thread ends, the module is collected, or ``bnb_gc_fix.reset()``.

A thread's record holds one entry per covered module at most (a module entered again switches its
earlier switch-on off first), and an entry goes when its forward ends: between steps the records are
usually empty, whatever the number of modules or threads ever seen. A module the fix cannot cover
(``bnb_gc_fix.cover``) keeps its pairs, so each of its pre-hooks' calls is a switch-on of its own, and each
off hook's call switches off the latest.

Every change keeps one order: an entry is made before the counter is raised, and dropped after it is
lowered, so a fork in between leaves the child one entry too many (switched off clamped at 0), never a
count that nobody switches off.
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
    """One thread's switch-ons not switched off yet: for each covered module (by ``id``), the ticket of
    its switch-on; in ``uncovered``, for each module the fix cannot cover, the tickets of its switch-ons,
    oldest first. Between steps both are usually empty, which keeps torch.compile's guards on the
    dictionary unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.uncovered: dict[int, list[int]] = {}

    def total(self) -> int:
        return len(self) + sum(len(tickets) for tickets in self.uncovered.values())

    def switch_off_all(self) -> None:
        cache.switch_off(cache.parametrize(), self.total())
        self.clear()
        self.uncovered.clear()

    def forget_module(self, key: int) -> None:
        """Drop every entry of the module (by ``id``), switching nothing off: the caller did."""
        self.pop(key, None)
        self.uncovered.pop(key, None)

    def of_module(self, key: int) -> int:
        """How many switch-ons of the module (by ``id``) are on."""
        return (key in self) + len(self.uncovered.get(key, ()))

    def __del__(self) -> None:  # its thread ended: a thread that switched nothing on touches nothing
        if not self and not self.uncovered:
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


def uncovered_switch_on(key: int, ticket: int) -> None:
    """Note a switch-on of a module the fix cannot cover (by ``id``) on this thread; the caller raises the
    counter next."""
    local.switch_ons.uncovered.setdefault(key, []).append(ticket)


def uncovered_switch_off(key: int) -> bool:
    """Switch off this thread's latest switch-on of a module the fix cannot cover (by ``id``), if it has
    one; returns whether it had."""
    uncovered = local.switch_ons.uncovered
    tickets = uncovered.get(key)
    if not tickets:
        return False
    cache.switch_off(cache.parametrize(), 1)
    tickets.pop()
    if not tickets:
        uncovered.pop(key, None)
    return True


def module_collected(key: int) -> None:
    """A module the fix recorded (by ``id``) is gone: switch off every thread's switch-ons for it."""
    for switch_ons in list(_threads.values()):
        cache.switch_off(cache.parametrize(), switch_ons.of_module(key))
        switch_ons.forget_module(key)


def switch_off_since(ticket: int) -> tuple[int, int]:
    """Switch off this thread's switch-ons made after ``ticket`` (a notebook cell's own); returns how many
    of covered modules' and how many of modules the fix cannot cover."""
    switch_ons = local.switch_ons
    covered = [key for key, taken in list(switch_ons.items()) if taken > ticket]
    uncovered = list(switch_ons.uncovered.items())
    later = [taken for _, tickets in uncovered for taken in tickets if taken > ticket]
    count = len(covered) + len(later)
    cache.switch_off(cache.parametrize(), count)
    for key in covered:
        del switch_ons[key]
    for key, _ in uncovered:
        _keep_until(switch_ons.uncovered, key, ticket)
    return len(covered), len(later)


def _keep_until(uncovered: dict[int, list[int]], key: int, ticket: int) -> None:
    """Drop the module's tickets later than ``ticket`` (and the module, where none is left)."""
    kept = [taken for taken in uncovered.get(key, ()) if taken <= ticket]
    if kept:
        uncovered[key] = kept
    else:
        uncovered.pop(key, None)


def count_every_thread() -> int:
    """How many of the counter's switch-ons are the fix's own forwards' (covered modules'), on every
    thread. Those of modules the fix cannot cover are not: an exception leaves them on, as the library's
    own hooks do."""
    return sum(len(switch_ons) for switch_ons in list(_threads.values()))


def forget_every_thread() -> None:
    """Every thread forgets its switch-ons, switching nothing off (the counter was reset)."""
    for switch_ons in list(_threads.values()):
        switch_ons.clear()
        switch_ons.uncovered.clear()


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
