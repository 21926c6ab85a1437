"""bnb-gc-fix's warning and exception classes, so users can filter or catch exactly its own; its logger;
and how its warnings reach the user's line."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType

import _bnb_gc_fix as words
from _bnb_gc_fix import startup

logger = logging.getLogger(words.PUBLIC)


class BnbGcFixWarning(UserWarning):
    """Base class of every warning bnb-gc-fix emits."""


class PatchSkippedWarning(BnbGcFixWarning):
    """The fix could not be applied safely (unexpected internals); ``status().reason`` says why."""


class SwitchValueWarning(BnbGcFixWarning):
    """``BNB_GC_FIX`` holds a value bnb-gc-fix does not know; it behaves as ``auto``."""


class CacheLeakWarning(BnbGcFixWarning):
    """The leak guard found the parametrization cache still switched on after a step: what it released,
    and what it left and why."""


class CacheLeakError(RuntimeError):
    """Raised by ``guard(strict=True)`` where a step left the parametrization cache switched on (after
    releasing what was provably left behind)."""

    def __init__(self, message: str, released: int, cached_bytes: int) -> None:
        super().__init__(message)
        self.released = released
        self.cached_bytes = cached_bytes


_OUR_FOLDERS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    startup.PACKAGE_DIR + os.sep,
)


def _is_our_file(filename: str) -> bool:
    path = filename if filename.startswith("<") else os.path.abspath(filename)
    return path.startswith(_OUR_FOLDERS)


def _is_import_machinery(filename: str) -> bool:
    return os.sep + "importlib" in filename or filename.startswith("<frozen importlib")


def _users_frame() -> FrameType:
    """The first frame, from :func:`warn`'s caller outwards, outside this package, the private one and
    the import system (the outermost frame if there is none)."""
    frame = sys._getframe(2)
    while frame.f_back is not None:
        filename = frame.f_code.co_filename
        if not _is_import_machinery(filename) and not _is_our_file(filename):
            break
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning], *, every_time: bool = False) -> None:
    """Warn at the user's line. ``every_time``: shown at every call under Python's default filters,
    which show a warning once per place and text (for a report that is news each time)."""
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
