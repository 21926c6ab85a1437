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

A cell may run cells (``%%capture`` runs its body as one, and so does ``get_ipython().run_cell(...)``):
the spans are a stack, each span paired with its end by IPython's ``ExecutionInfo``, which
``pre_run_cell`` gets and ``post_run_cell``'s result carries back. A cell that a cell ran switches off
what was left inside it when it ends; the outer cell's end, what was left in it after that. The report
waits for the end of the cell the user ran, and goes where that cell's output went when it began:
``%%capture`` never swallows it. An end without a beginning (the package installed mid-cell, a blank
cell) ends no span.
IPython is never imported: the package looks for a running shell in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

from bnb_gc_fix import cache, ledger
from bnb_gc_fix.lines import counted, message
from bnb_gc_fix.status import status
from bnb_gc_fix.warning import logger

BEFORE = "pre_run_cell"
AFTER = "post_run_cell"


@dataclass(frozen=True)
class Span:
    """A running cell's span: where it began (the last ticket given out, torch's counter), which cell it
    is (IPython's ``ExecutionInfo``, which its ``post_run_cell`` gets back), the stream that was
    ``sys.stderr`` when it began, and the endings of the cells it ran (kept for its own end)."""

    ticket: int
    counter: int
    cell: Any = None
    stderr: Any = None
    within: list[Ending] = field(default_factory=list)

    @classmethod
    def begin(cls, cell: Any = None) -> Span:
        return cls(ticket=next(ledger.tickets), counter=cache.counter(), cell=cell, stderr=sys.stderr)

    def end(self) -> Ending:
        """Switch off this thread's switch-ons made in the span and still on, and say what the span left,
        with what the cells it ran left (theirs were switched off when they ended)."""
        cached = cache.cached_bytes()
        switched_off = ledger.switch_off_since(self.ticket)
        counter = cache.counter()
        ending = Ending(switched_off, counter, max(counter - self.counter, 0), cached)
        for earlier in self.within:
            ending = ending.including(earlier)
        return ending


@dataclass(frozen=True)
class Ending:
    """What a span found when it ended."""

    switched_off: int  # the fix's switch-ons made in the span on its thread and left on, switched off
    counter: int  # torch's counter once those were switched off
    left: int  # how far the counter still stands above where it stood when the span began
    cached_bytes: int  # what the cache held before anything was switched off (the most, with cells it ran)

    def including(self, earlier: Ending) -> Ending:
        """This ending, with what a cell that the span ran switched off and found cached when it ended."""
        switched_off = self.switched_off + earlier.switched_off
        cached_bytes = max(self.cached_bytes, earlier.cached_bytes)
        return Ending(switched_off, self.counter, self.left, cached_bytes)

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


#: More spans than any cell that runs cells opens: beyond it, the oldest goes (a shell that fires no
#: ``post_run_cell`` never grows the stack without bound).
MOST_SPANS = 64


class _Cells:
    """The shell the callbacks are registered with, and its running cells' spans, the outermost first."""

    def __init__(self) -> None:
        self.shell: Any = None
        self.spans: list[Span] = []


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
        _cells.spans.clear()  # another shell's
    except Exception as error:  # a shell we do not understand: the fix goes on without the release
        logger.debug("cell-end release not installed: %s: %s", type(error).__name__, error)


def registered() -> bool:
    """Whether the callbacks are registered with a running shell right now."""
    try:
        return _after_cell in _cells.shell.events.callbacks[AFTER]
    except Exception:  # no shell
        return False


def _before_cell(info: Any = None) -> None:
    """Push the span of the cell that begins (``info``: its ``ExecutionInfo``; none before IPython 7)."""
    with contextlib.suppress(Exception):
        _push(Span.begin(info))


def _push(span: Span) -> None:
    """Push ``span`` on the stack; beyond ``MOST_SPANS``, the oldest goes (its end never came)."""
    spans = _cells.spans
    spans.append(span)
    if len(spans) > MOST_SPANS:
        del spans[0]


def _after_cell(result: Any = None) -> None:
    """End the span of the cell that ends, and any of the cells it ran whose end never came, the innermost
    first; a cell without a span (it began before the callbacks were registered) ends none. Never raises
    into the shell."""
    try:
        stays = _spans_below(result)
        while len(_cells.spans) > stays:
            _end(_cells.spans.pop())
    except Exception as error:
        logger.debug("cell-end release failed: %s: %s", type(error).__name__, error)


def _spans_below(result: Any) -> int:
    """How many spans stay once the cell of ``result`` (IPython's ``ExecutionResult``) ends: those below its
    span, or all of them where none is its own."""
    spans = _cells.spans
    cell = getattr(result, "info", None)
    if cell is None:  # before IPython 7 (no result), or running the cell raised (None): the innermost's
        return max(len(spans) - 1, 0)
    for depth in range(len(spans) - 1, -1, -1):
        if spans[depth].cell is cell:
            return depth
    if spans and _the_same_cell(spans[-1].cell, cell):
        return len(spans) - 1
    return len(spans)  # a blank cell (no pre_run_cell), or one begun before the callbacks were registered


def _the_same_cell(began: Any, ended: Any) -> bool:
    """Whether ``ended`` is the cell ``began`` as IPython ends a cell whose run raised out of its coroutine:
    a new ``ExecutionInfo`` of the same code (``InteractiveShell._run_cell``)."""
    code = getattr(began, "raw_cell", None)
    same_code = code is not None and code == getattr(ended, "raw_cell", None)
    return same_code and getattr(began, "cell_id", None) == getattr(ended, "cell_id", None)


def _end(span: Span) -> None:
    """End ``span`` (already off the stack). A cell that another cell ran hands its ending to that cell;
    the outermost cell, the one the user ran, prints the report of all of them at its end, to the stream
    that was ``sys.stderr`` when it began (in Jupyter, the kernel's stream that shows the cell's output).

    Why there and then: a cell that runs a cell may have replaced ``sys.stderr`` when that cell ends
    (``%%capture`` does, and drops what it captured unless it is named), yet what was switched off, and
    whether the cache is still on, is what the user needs after the cell they ran, whoever captured its
    output. One report, at the end of that cell, sums what it and the cells it ran left."""
    ending = span.end()
    spans = _cells.spans
    if spans:
        spans[-1].within.append(ending)
        return
    if not ending.clean:
        print(ending.report("bnb_gc_fix", "this cell"), file=span.stderr, flush=True)
