"""The cell-end release: in IPython and Jupyter, what a failed cell left switched on is released.

A notebook's stop button raises ``KeyboardInterrupt`` inside a forward, which skips its forward hooks.
At each cell's end (IPython's callbacks; IPython is never imported), what a failed cell left behind is
given back as far as it is provably its own (:mod:`bnb_gc_fix.release`: a kernel always runs other
threads, so a hold no gate accounts for is pointed out instead), what a cell that succeeded holds is
pointed out, and a counter below 0 is put back to 0.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from _bnb_gc_fix import cache
from bnb_gc_fix.errors import logger

BEFORE = "pre_run_cell"  # IPython's event before each cell
AFTER = "post_run_cell"  # and after it, with its result


class _Registration:
    shell: Any = None
    noted: int | None = None  # the counter value last pointed out after a cell that succeeded
    start = 0  # the counter when the running cell began


_registration = _Registration()


def _running_shell() -> Any:
    """The running IPython shell; None outside IPython, or where IPython is imported without a shell.
    Never imports IPython."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    if get_ipython is None:
        return None
    return get_ipython()


def install() -> None:
    """Register the callbacks with the running IPython shell, once (none: nothing to do)."""
    try:
        shell = _running_shell()
        if getattr(shell, "events", None) is not None and _registration.shell is not shell:
            remove()
            shell.events.register(BEFORE, _before_cell)
            shell.events.register(AFTER, _after_cell)
            _registration.shell = shell
    except Exception as error:  # a shell we do not understand: the fix goes on without the release
        logger.debug("cell-end release not installed: %s: %s", type(error).__name__, error)


def remove() -> None:
    """Unregister both callbacks from the shell they were registered with, if any."""
    shell = _registration.shell
    _registration.shell = None
    for event, callback in ((BEFORE, _before_cell), (AFTER, _after_cell)):
        with contextlib.suppress(Exception):  # no shell, or already gone (the user cleared the events)
            shell.events.unregister(event, callback)


def registered() -> bool:
    """Whether the cell-end callback is registered with a shell right now."""
    try:
        return _after_cell in _registration.shell.events.callbacks[AFTER]
    except Exception:  # no shell
        return False


def _say(message: str, level: int) -> None:
    """Log, and print to stderr: the ``bnb_gc_fix`` logger's NullHandler shows nothing in a notebook."""
    logger.log(level, message)
    with contextlib.suppress(Exception):  # a closed or odd stderr
        print(f"bnb_gc_fix: {message}", file=sys.stderr, flush=True)


def _before_cell(info: Any = None) -> None:
    """``pre_run_cell`` callback: remember the counter the cell starts with; never raises."""
    _registration.start = 0
    with contextlib.suppress(Exception):
        _registration.start = cache.counter()


def _note(count: int) -> None:
    """Point out a cache left on that is not released here, once per counter value."""
    if count != _registration.noted:
        _registration.noted = count
        _say(
            f"torch's parametrization cache is still on after this cell (counter {count}, "
            f"{cache.cached_bytes()} bytes cached); bnb_gc_fix.reset() releases it if that is not "
            "on purpose.",
            logging.INFO,
        )


def _reset_below_zero(count: int) -> None:
    """A ``P.cached()`` exited after we (or ``reset()``) released its hold: torch would never empty the
    cache at a counter below 0, so put it back to 0 and say so."""
    cache.reset()
    _say(
        f"torch's parametrization cache counter was {count} (a hold given back twice, "
        "such as a P.cached() exited after it was released); put it back to 0 and emptied the cache.",
        logging.WARNING,
    )


def _release_after_failed_cell(count: int, error: BaseException) -> None:
    """Give back what the failed cell left behind; point out anything older, and say what stays."""
    from bnb_gc_fix.release import left_text, release_left_behind  # imports torch, which holds something

    found = release_left_behind(count - max(_registration.start, 0))
    if not found.released and not found.left:  # older than this cell, or owned by a running call
        _note(count)
        return
    _registration.noted = None
    cause = f"this cell's {type(error).__name__}"
    if found.released:
        message = (
            f"released {found.released} of torch's parametrization cache holds (counter {count} -> "
            f"{cache.counter()}, {found.cached_bytes} bytes cached), left switched on by {cause}: "
            f"{cache.CAUSE}."
        )
    else:
        message = (
            f"torch's parametrization cache is still on after {cause} (counter {count}, "
            f"{found.cached_bytes} bytes cached)."
        )
    if found.left:
        message += f" {left_text(found.left)}."
    _say(message, logging.WARNING)


def _check_after_cell(result: Any) -> None:
    """What a cell left: a counter below 0 is reset, a hold a failed cell left behind is released,
    and a cache still on after a cell that succeeded is pointed out."""
    count = cache.counter()  # 0 while torch's parametrize is not imported: nothing can be held
    if count < 0:
        _reset_below_zero(count)
    if count <= 0:
        _registration.noted = None
        return
    error = getattr(result, "error_in_exec", None)
    if error is None:  # succeeded, or never ran (a syntax error): the cell did not skip a hook
        _note(count)
        return
    _release_after_failed_cell(count, error)


def _after_cell(result: Any = None) -> None:
    """``post_run_cell`` callback; never raises into the shell."""
    try:
        _check_after_cell(result)
    except Exception as failure:
        logger.debug("cell-end release failed: %s: %s", type(failure).__name__, failure)
