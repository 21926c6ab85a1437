"""Post-import callbacks: run a function once a watched module's code has run to its end.

The start-up hook's loader (:class:`_bnb_gc_fix_boot.WatchingLoader`) tells this registry when a watched
module starts and finishes executing; activation registers what to do then with :func:`when_imported`.
Standard library only: the start-up hook loads it the first time a watched module executes.
"""

# No `from __future__ import annotations`: see _bnb_gc_fix_vocabulary.
import _thread  # built in, loaded before site runs
import os
import sys

import _bnb_gc_fix_vocabulary as vocabulary

TYPE_CHECKING = False  # typing is not loaded at start-up; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Callable

_lock = _thread.allocate_lock()
_executing: "set[str]" = set()
_callbacks: "dict[str, set[Callable[[str], None]]]" = {}


def _renew_lock() -> None:
    """A forked child never waits on a lock that one of its parent's other threads held."""
    global _lock
    _lock = _thread.allocate_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


def started(name: str) -> None:
    """The watched module ``name`` is about to execute."""
    with _lock:
        _executing.add(name)


def finished(name: str, completed: bool) -> None:
    """The watched module ``name`` has stopped executing: run its callbacks if its code ran to its end.

    After a failure the import system drops the half-made module, so the callbacks wait for the next
    import. What a callback raises is dropped: it must never break the user's import.
    """
    with _lock:
        _executing.discard(name)
        callbacks = _callbacks.pop(name, set()) if completed else set()
    for callback in callbacks:
        try:
            callback(name)
        except Exception:
            pass


def when_imported(name: str, callback: "Callable[[str], None]") -> bool:
    """Call ``callback(name)`` once the watched module ``name`` has run to its end through a watcher's
    loader: the import under way now, else the next successful one.

    Returns False, and never calls back, when ``name`` is not watched, is imported already, or is being
    imported by a loader no watcher wraps. A callback registered twice runs once. A watcher goes first on
    ``sys.meta_path`` unless the first finder is one: a finder put in front of the start-up hook's may
    answer for the module.
    """
    if name not in vocabulary.WATCHED:
        return False
    with _lock:
        if name in sys.modules and name not in _executing:
            return False
        _callbacks.setdefault(name, set()).add(callback)
        if name in _executing:
            return True
    _watch_first()
    return True


def _watch_first() -> None:
    """Put a watcher first on ``sys.meta_path`` unless one is first already.

    Activation calls this from the user's code or from an import's code; and, where a watcher activates
    the fix from its ``find_spec`` (a spec it cannot wrap), inside the import system's loop over
    ``sys.meta_path``. The insertion then makes that one loop ask a finder twice, which is harmless:
    a watcher answers the same way both times.
    """
    import _bnb_gc_fix_boot as boot

    first = sys.meta_path[0] if sys.meta_path else None
    if not boot.is_watcher(first):
        sys.meta_path.insert(0, boot.BitsandbytesWatcher(via=None))
