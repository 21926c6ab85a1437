"""Which releases leak this way: read from version strings, never by importing anything."""

from __future__ import annotations

import sys

from packaging.version import InvalidVersion, Version

from _bnb_gc_fix import Library

MIN_TORCH = Version("2.1")  # forward hooks that torch calls when the forward raises (always_call)


def version_of(name: str) -> str | None:
    """``name.__version__`` if that module is imported (never imports it)."""
    version = getattr(sys.modules.get(name), "__version__", None)
    return None if version is None else str(version)


def release(version: str | None) -> Version | None:
    """The release numbers of a version (0.50.0.dev0 counts as 0.50.0); None when unreadable."""
    try:
        return Version(Version(str(version)).base_version)
    except InvalidVersion:
        return None


def affected(library: Library, version: str | None) -> bool | None:
    """Whether a release of the library registers the leaking pair (None: the version is unreadable)."""
    number = release(version)
    if number is None:
        return None
    return Version(library.first_affected) <= number < Version(library.first_fixed)


def predates(library: Library, version: str | None) -> bool:
    """Whether a release of the library comes before its first affected one (and has no such module)."""
    number = release(version)
    return number is not None and number < Version(library.first_affected)


def fixed_upstream(library: Library, version: str | None) -> bool:
    """Whether a release of the library is one of those that fixed the leak themselves."""
    number = release(version)
    return number is not None and number >= Version(library.first_fixed)
