"""bnb-gc-fix's warnings and exceptions (so that users can filter or catch exactly its own), its logger, and
how a warning reaches the user's line."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType

logger = logging.getLogger("bnb_gc_fix")


class BnbGcFixWarning(UserWarning):
    """Every warning of bnb-gc-fix."""


class PatchSkippedWarning(BnbGcFixWarning):
    """The fix could not be put in place safely; ``status().reason`` says why."""


class SwitchValueWarning(BnbGcFixWarning):
    """``BNB_GC_FIX`` holds a value bnb-gc-fix does not know; it behaves as ``auto``."""


class CacheLeakWarning(BnbGcFixWarning):
    """A safety net found torch's parametrization cache left switched on after a step or a cell."""


class CacheLeakError(RuntimeError):
    """``guard(strict=True)``: the step left holds on the cache that the guard could not give back."""

    def __init__(self, message: str, left: int, cached_bytes: int) -> None:
        super().__init__(message)
        self.left = left
        self.cached_bytes = cached_bytes


_OUR_FOLDER = os.path.dirname(os.path.abspath(__file__)) + os.sep
_OUR_START_UP_MODULE = sys.modules["_bnb_gc_fix"].__file__ if "_bnb_gc_fix" in sys.modules else "_bnb_gc_fix"


def _is_ours_or_the_import_system(filename: str) -> bool:
    if filename.startswith("<frozen importlib") or os.sep + "importlib" + os.sep in filename:
        return True
    path = os.path.abspath(filename)
    return path.startswith(_OUR_FOLDER) or path == _OUR_START_UP_MODULE


def _users_frame() -> FrameType:
    """The innermost frame outside bnb-gc-fix and the import system (the outermost if all are)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _is_ours_or_the_import_system(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning], *, every_time: bool = False) -> None:
    """Warn at the user's line. ``every_time``: shown at each call under Python's default filters (which
    show a warning once per line and text), for a report that is news each time."""
    frame = _users_frame()
    registry = None if every_time else frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__"),
        registry=registry,
    )


def warn_quietly(message: str, category: type[Warning]) -> None:
    """:func:`warn`, except where warnings are errors (``-W error``): then the log gets it, since this
    runs inside the user's import, which must never fail because of bnb-gc-fix."""
    try:
        warn(message, category)
    except Exception:
        logger.warning("%s", message)
