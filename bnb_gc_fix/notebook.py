"""The cell-end release: in IPython and Jupyter, what a cell's Ctrl-C left switched on is switched off.

A notebook's stop button raises ``KeyboardInterrupt`` inside a forward, where torch runs no forward hook.
Each cell is a span (:mod:`bnb_gc_fix.span`), from IPython's ``pre_run_cell`` event to its
``post_run_cell``; the cell's output says what was switched off, and what is still on and what may keep it
on. IPython is never imported: the package looks for a running shell in ``sys.modules``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from bnb_gc_fix.errors import logger
from bnb_gc_fix.span import Span

BEFORE = "pre_run_cell"
AFTER = "post_run_cell"


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
    """Say in the cell's output (stderr, and the logger) what the cell left; never raises into the shell."""
    try:
        span, _cells.span = _cells.span, None
        if span is None:
            return
        ending = span.end()
        if not ending.clean:
            message = ending.report("bnb_gc_fix", "this cell")
            logger.warning("%s", message)
            print(message, file=sys.stderr, flush=True)
    except Exception as error:
        logger.debug("cell-end release failed: %s: %s", type(error).__name__, error)
