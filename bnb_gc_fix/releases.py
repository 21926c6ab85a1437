"""Release numbers, read from version strings, never by importing anything: only a cross-check of what a
library's code was read to do (``status()`` says where the two disagree), and torch's minimum."""

from __future__ import annotations

import sys

from packaging.version import InvalidVersion, Version

from bnb_gc_fix.libraries import Library

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


def in_the_leaking_range(library: Library, version: str | None) -> bool | None:
    """Whether the library's release number is one of those that registered the leaking pair (a
    development build of the first fixed release, 0.50.0.dev0, is before it); None when unreadable."""
    try:
        number = Version(str(version))
    except InvalidVersion:
        return None
    return Version(library.first_affected) <= number < Version(library.first_fixed)
