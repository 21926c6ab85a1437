"""What the safety nets may give back: only what is provably theirs.

The leak guard (:mod:`bnb_gc_fix.guard`, and the Trainer callback built on it) and the notebook's
cell-end release (:mod:`bnb_gc_fix.notebook`) measure how far torch's counter rose during a step or a
cell, then call :func:`release_left_behind`. It gives back this thread's gate holds whose calls have
ended. A rise that no gate accounts for (another thread's ``P.cached()`` block, or a pair nobody
patched) goes too only where no other Python thread runs, since another thread could own it and give
it back itself (twice given back, the counter goes below zero, which torch reads as "on"); otherwise
it is left, for the caller to report.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from _bnb_gc_fix import cache
from bnb_gc_fix import gate


@dataclass(frozen=True)
class Release:
    """What a safety net found after a step or a cell."""

    released: int  # holds given back: ended calls of this thread's gates, and what no one could own
    left: int  # holds of the rise left in place: no gate accounts for them, and other threads run
    cached_bytes: int  # what the cache held before anything was given back


def release_left_behind(rise: int) -> Release:
    """Give back this thread's gate holds whose calls have ended (whenever they were taken), and of the
    counter's ``rise`` during the step or cell what no gate accounts for, where no other thread runs;
    see the module."""
    cached = cache.cached_bytes()
    ended = gate.give_back_ended()
    gates_hold = sum(len(thread_holds.holds) for thread_holds in gate.all_thread_holds())
    unaccounted = min(rise - ended, cache.counter() - gates_hold)
    if unaccounted <= 0:
        return Release(released=ended, left=0, cached_bytes=cached)
    if threading.active_count() > 1:
        return Release(released=ended, left=unaccounted, cached_bytes=cached)
    cache.give_back(unaccounted)
    return Release(released=ended + unaccounted, left=0, cached_bytes=cached)


def left_text(left: int) -> str:
    """What a report says of holds left in place, and what to do."""
    return (
        f"{left} holds that no call of this thread accounts for (a P.cached() block, or a pair of hooks "
        "bnb-gc-fix did not replace) stay in place: other threads are running, and one of them may own "
        "them; if they are not held on purpose, bnb_gc_fix.reset() releases them once those threads are done"
    )
