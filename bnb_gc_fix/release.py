"""What the safety nets may give back: the holds a step or a cell left behind that nothing live owns.

The leak guard (:mod:`bnb_gc_fix.guard`, and the Trainer callback built on it) and the notebook's
cell-end release (:mod:`bnb_gc_fix.notebook`) both end with :func:`release_left_behind`. It gives back
this thread's gate holds whose calls have ended, then holds no gate accounts for (a plain pair that
lost its "off"), and never another thread's gate holds: those may belong to calls still running.
"""

from __future__ import annotations

import sys
import threading

import _bnb_gc_fix_cache as cache
from bnb_gc_fix import gate


@gate.eager_only
def release_left_behind(added: int) -> int:
    """Give back at most ``added`` holds (the counter's rise during a safety net's step or cell) that
    nothing live owns; returns how many were given back."""
    counter = cache.counter()
    budget = min(added, counter)
    if budget <= 0:
        return 0
    stack = list(gate.stack_from(sys._getframe()))
    me = threading.get_ident()
    everyone = gate.every_holds()
    released = 0
    for holds in everyone:
        if holds.thread != me or released >= budget:
            continue
        stale = len(holds.calls) - gate.live_holds(holds, stack)
        released += holds.forget(min(stale, budget - released))  # given back below, with the others
    accounted = sum(len(holds.calls) for holds in everyone)
    unaccounted = counter - released - accounted
    if unaccounted > 0:
        released += min(unaccounted, budget - released)
    if released:
        cache.give_back(released)
    return released
