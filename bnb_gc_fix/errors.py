"""Warning and exception classes of bnb-gc-fix, so users can filter or catch exactly ours."""

from __future__ import annotations


class BnbGcFixWarning(UserWarning):
    """Base class of every warning bnb-gc-fix emits."""


class PatchSkippedWarning(BnbGcFixWarning):
    """The fix could not be applied safely (unexpected internals); ``status().reason`` says why."""


class SwitchValueWarning(BnbGcFixWarning):
    """``BNB_GC_FIX`` holds a value bnb-gc-fix does not know; it behaves as ``auto``."""


class CacheLeakWarning(BnbGcFixWarning):
    """The leak guard found the parametrization cache still switched on after a step and released it."""


class CacheLeakError(RuntimeError):
    """Raised by ``guard(strict=True)`` after it released a stuck parametrization cache."""

    def __init__(self, message: str, released: int, cached_bytes: int) -> None:
        super().__init__(message)
        self.released = released
        self.cached_bytes = cached_bytes
