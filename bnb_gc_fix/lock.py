"""The package's one lock: held to turn the fix on, to decide for a library, and to cover a module."""

from __future__ import annotations

import os
import threading

_lock = threading.RLock()


def held() -> threading.RLock:
    """The lock, for ``with lock.held():``."""
    return _lock


def _renew() -> None:  # a forked child never waits on a lock another thread of its parent held
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # not on Windows, which never forks
    os.register_at_fork(after_in_child=_renew)
