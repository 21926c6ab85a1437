"""Release numbers, read from version strings, never by importing anything: the versions imported, and
torch's minimum. What a library's hooks do is read from its code (``bnb_gc_fix.reading``), never from its
version."""

from __future__ import annotations

import sys

from packaging.version import InvalidVersion, Version

MIN_TORCH = Version("2.1")  # forward hooks that torch calls when the forward raises (always_call)


def version_of(name: str) -> str | None:
    """``name.__version__`` if that module is imported (never imports it)."""
    version = getattr(sys.modules.get(name), "__version__", None)
    return None if version is None else str(version)


def release(version: str | None) -> Version | None:
    """The release numbers of a version, for torch's minimum (2.4.0a0+git... is 2.4.0); None when
    unreadable."""
    try:
        return Version(Version(str(version)).base_version)
    except InvalidVersion:
        return None
