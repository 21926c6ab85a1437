"""The cell-end release: in IPython and Jupyter, what a cell's Ctrl-C left switched on is switched off.

A notebook's stop button raises ``KeyboardInterrupt`` inside a forward, where torch runs no forward hook.
Each cell is a span, from IPython's ``pre_run_cell`` event to its ``post_run_cell``, on the shell's
thread, with one rule: switch off only what is provably the cell's own, and report the rest. What it
switches off when it ends are the switch-ons that the fix's forwards made on that thread inside the cell
and that are still on: every call that started there has returned or unwound by then, so those were left
by a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``,
``GeneratorExit``), for which torch runs no forward hook. Nothing else is switched off: another thread's,
``P.cached()`` blocks, the libraries' own hooks (the fix off, or not needed), those from before the cell.
The cell's output says what was switched off, and, where the cache is still on, what may keep it on.
IPython is never imported: the package looks for a running shell in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

from bnb_gc_fix import cache, ledger
from bnb_gc_fix.lines import counted, message
from bnb_gc_fix.status import status
from bnb_gc_fix.warning import logger

BEFORE = "pre_run_cell"
AFTER = "post_run_cell"


@dataclass(frozen=True)
class Span:
    """Where a span began: the last ticket given out, and torch's counter."""

    ticket: int
    counter: int

    @classmethod
    def begin(cls) -> Span:
        return cls(ticket=next(ledger.tickets), counter=cache.counter())

    def end(self) -> Ending:
        """Switch off this thread's switch-ons made in the span, and say what is still on."""
        cached = cache.cached_bytes()
        switched_off = ledger.switch_off_since(self.ticket)
        counter = cache.counter()
        return Ending(switched_off, counter, max(counter - self.counter, 0), cached)


@dataclass(frozen=True)
class Ending:
    """What a span found when it ended."""

    switched_off: int  # the fix's switch-ons made in the span on its thread, left by a BaseException
    counter: int  # torch's counter once those were switched off
    left: int  # how far the counter still stands above where it stood when the span began
    cached_bytes: int  # what the cache held before anything was switched off

    @property
    def clean(self) -> bool:
        return self.switched_off == 0 and self.left == 0

    def report(self, who: str, where: str) -> str:
        """The report of a span that did not end clean, in words the user can act on, in lines of at most
        100 characters: what ``where`` (this cell) left, what ``who`` did, and what is still on."""
        parts = []
        if self.switched_off:
            forwards = counted(self.switched_off, "forward")
            pronoun = "that" if self.switched_off == 1 else "those"
            parts.append(
                f"{forwards} in {where} switched the cache on and stopped before switching it off (by "
                "KeyboardInterrupt, SystemExit or another BaseException that is not an Exception: torch runs "
                f"no forward hook then). bnb-gc-fix switched {pronoun} off."
            )
        if self.counter == 0:
            parts.append(f"The cache is off and empty now ({self.cached_bytes} bytes were cached).")
        else:
            above = f", {self.left} above where it was when {where} began" if self.left else ""
            keeping = status().who_keeps_it_on()
            parts.append(f"The cache is still on (counter {self.counter}{above}): {keeping}.")
        return message(f"{who}: {where} left the cache switched on.", " ".join(parts))


class _Cells:
    shell: Any = None  # the shell the callbacks are registered with
    span: Span | None = None  # the running cell's


_cells = _Cells()


def _running_shell() -> Any:
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return None if get_ipython is None else get_ipython()


def install() -> None:
    """Register the callbacks with the running IPython shell, once (none running: nothing to do)."""
    try:
        shell = _running_shell()
        if getattr(shell, "events", None) is None or _cells.shell is shell:
            return
        shell.events.register(BEFORE, _before_cell)
        shell.events.register(AFTER, _after_cell)
        _cells.shell = shell
    except Exception as error:  # a shell we do not understand: the fix goes on without the release
        logger.debug("cell-end release not installed: %s: %s", type(error).__name__, error)


def registered() -> bool:
    """Whether the callbacks are registered with a running shell right now."""
    try:
        return _after_cell in _cells.shell.events.callbacks[AFTER]
    except Exception:  # no shell
        return False


def _before_cell(info: Any = None) -> None:
    with contextlib.suppress(Exception):
        _cells.span = Span.begin()


def _after_cell(result: Any = None) -> None:
    """Say in the cell's output (stderr) what the cell left; never raises into the shell."""
    try:
        span, _cells.span = _cells.span, None
        if span is None:
            return
        ending = span.end()
        if not ending.clean:
            print(ending.report("bnb_gc_fix", "this cell"), file=sys.stderr, flush=True)
    except Exception as error:
        logger.debug("cell-end release failed: %s: %s", type(error).__name__, error)
