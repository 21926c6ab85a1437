"""bnb-gc-fix's warnings (so that users can filter exactly its own), its logger, and how a warning reaches
the user's line."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType

from bnb_gc_fix.libraries import LIBRARIES

logger = logging.getLogger("bnb_gc_fix")


class BnbGcFixWarning(UserWarning):
    """Every warning of bnb-gc-fix."""


class PatchSkippedWarning(BnbGcFixWarning):
    """The fix could not be put in place safely; ``status().reason`` says why."""


class SwitchValueWarning(BnbGcFixWarning):
    """``BNB_GC_FIX`` holds a value bnb-gc-fix cannot act on: one it does not know (it behaves as
    ``auto``), or an off switch read after the fix turned on (it stays on)."""


_OUR_FOLDER = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: The libraries' top packages: a warning given inside their quantizing call is the user's call's.
_LIBRARY_PACKAGES = tuple(library.module_name.split(".")[0] for library in LIBRARIES)
_OUR_START_UP_MODULE = sys.modules["_bnb_gc_fix"].__file__ if "_bnb_gc_fix" in sys.modules else "_bnb_gc_fix"


def _is_ours_or_the_import_system(filename: str) -> bool:
    if filename.startswith("<frozen importlib") or os.sep + "importlib" + os.sep in filename:
        return True
    path = os.path.abspath(filename)
    return path.startswith(_OUR_FOLDER) or path == _OUR_START_UP_MODULE


def _in_a_library(frame: FrameType) -> bool:
    name = str(frame.f_globals.get("__name__", ""))
    return name.split(".")[0] in _LIBRARY_PACKAGES


def _users_frame() -> FrameType:
    """The innermost frame outside bnb-gc-fix, the import system and the libraries the fix goes into (the
    outermost if all are)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        _is_ours_or_the_import_system(frame.f_code.co_filename) or _in_a_library(frame)
    ):
        frame = frame.f_back
    return frame


def warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line (shown once per line and text under Python's default filters)."""
    frame = _users_frame()
    registry = frame.f_globals.setdefault("__warningregistry__", {})
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
