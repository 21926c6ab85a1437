"""The cell-end release: in IPython and Jupyter, a cell that fails never leaves the cache switched on.

The stop button of a notebook raises ``KeyboardInterrupt`` inside whatever runs, usually a
forward. torch runs no forward hook when a ``BaseException`` leaves a forward, so the hook that
switches torch's parametrization cache off never runs, on every bitsandbytes from 0.48 on
(0.50's always-called hook included). This module registers one ``post_run_cell`` callback with
the running IPython shell:

* a cell that ended with an exception and left the counter higher than it found it gets what it
  added released, as far as no running call (another thread's ``P.cached()`` block, a live
  forward) owns it (:func:`bnb_gc_fix.gate.release_left_behind`), with one line on stderr (the
  cell's output) saying what was released and why; holds older than the cell are left alone;
* a cell that ended without an exception and left the counter above zero is left alone (the
  cache may be held across cells on purpose, with ``P.cached().__enter__()``); one line says so
  and points at :func:`bnb_gc_fix.reset`, once per counter value;
* a counter left below zero (a hold given back twice: a ``P.cached()`` held by hand that was
  released here and exited later) is put back to zero, since torch treats it as switched on.

It costs nothing on the forward path, and nothing at all outside IPython: the shell is reached
through ``sys.modules``, so this package never imports IPython.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("bnb_gc_fix")

EVENT = "post_run_cell"
BEFORE = "pre_run_cell"
_PARAMETRIZE = "torch.nn.utils.parametrize"
_CAUSE = (
    "a forward left by an exception (the stop button's KeyboardInterrupt) skips the hook that switches it off"
)


class _Registration:
    def __init__(self) -> None:
        self.shell: Any = None
        self.noted: int | None = None  # the counter value last pointed out after a cell that succeeded
        self.start = 0  # the counter when the running cell began


_registration = _Registration()


def _shell() -> Any:
    """The running IPython shell, or None (outside IPython, or IPython imported without a shell)."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None:
        return None
    shell = get_ipython()
    if shell is None or getattr(shell, "events", None) is None:
        return None
    return shell


def install() -> bool:
    """Register the callback with the running IPython shell, once. Returns whether it is registered."""
    try:
        shell = _shell()
        if shell is None:
            return installed()
        if _registration.shell is shell:
            return True
        remove()
        shell.events.register(BEFORE, _before_cell)
        shell.events.register(EVENT, _after_cell)
        _registration.shell = shell
        return True
    except Exception as error:  # a shell we do not understand: the fix goes on without the release
        logger.debug("cell-end release not installed: %s: %s", type(error).__name__, error)
        return installed()


def remove() -> None:
    """Unregister the callback, if registered."""
    shell, _registration.shell = _registration.shell, None
    if shell is None:
        return
    for event, callback in ((BEFORE, _before_cell), (EVENT, _after_cell)):
        try:
            shell.events.unregister(event, callback)
        except Exception:  # already gone (the user cleared the events)
            pass


def installed() -> bool:
    """Whether the callback is registered with a shell right now."""
    shell = _registration.shell
    if shell is None:
        return False
    try:
        return _after_cell in shell.events.callbacks[EVENT]
    except Exception:
        return False


def _say(message: str, level: int) -> None:
    """The ``bnb_gc_fix`` logger has a NullHandler: a record alone would be invisible in a notebook."""
    logger.log(level, message)
    try:
        print(f"bnb_gc_fix: {message}", file=sys.stderr, flush=True)
    except Exception:  # a closed or odd stderr
        pass


def _before_cell(info: Any = None) -> None:
    """``pre_run_cell`` callback: remember the counter the cell starts with; never raises."""
    try:
        from bnb_gc_fix.guard import counter_now

        _registration.start = counter_now()
    except Exception:
        _registration.start = 0


def _after_cell(result: Any = None) -> None:
    """``post_run_cell`` callback; never raises into the shell."""
    try:
        _check(result)
    except Exception as error:
        logger.debug("cell-end release failed: %s: %s", type(error).__name__, error)


def _note(count: int) -> None:
    """Point out a cache left on that is not released here, once per counter value."""
    from bnb_gc_fix import gate

    if count != _registration.noted:
        _registration.noted = count
        _say(
            f"torch's parametrization cache is still on after this cell (counter {count}, "
            f"{gate.cached_bytes()} bytes cached); bnb_gc_fix.reset() releases it if that is not "
            "on purpose.",
            logging.INFO,
        )


def _check(result: Any) -> None:
    if _PARAMETRIZE not in sys.modules:  # torch's parametrize never loaded: nothing can be held
        return
    from bnb_gc_fix import gate

    count = gate.counter()
    if count < 0:
        # A hold given back twice: a `P.cached()` held by hand and released by us (or by reset())
        # was exited or collected later. torch reads any non-zero counter as "on" and never empties
        # the cache again, so put it back to zero.
        gate.reset()
        _say(
            f"torch's parametrization cache counter was {count} (a hold given back twice, "
            "such as a P.cached() exited after it was released); put it back to 0 and emptied the cache.",
            logging.WARNING,
        )
    if count <= 0:
        _registration.noted = None
        return
    error = getattr(result, "error_in_exec", None)
    if error is None:  # succeeded, or never ran (a syntax error): the cell did not skip a hook
        _note(count)
        return
    start = max(_registration.start, 0)
    cached = gate.cached_bytes()
    released = gate.release_left_behind(count - start)
    if not released:
        # The holds predate this cell, or a running call (another thread's) still owns them: not
        # this cell's doing, and not ours to give back.
        _note(count)
        return
    _registration.noted = None
    _say(
        f"released {released} of torch's parametrization cache holds (counter {count} -> "
        f"{gate.counter()}, {cached} bytes cached), left switched on by this cell's "
        f"{type(error).__name__}: {_CAUSE}.",
        logging.WARNING,
    )
