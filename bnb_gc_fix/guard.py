"""The leak guard: an explicit check around one training step, whether or not the fix is active."""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType

from _bnb_gc_fix import cache
from bnb_gc_fix.errors import CacheLeakError, CacheLeakWarning, logger, warn


def check_and_release(strict: bool = False, start: int = 0, where: str = "the step") -> int:
    """Release what is provably left behind (:mod:`bnb_gc_fix.release`; of what no gate accounts for,
    only the counter's rise since it was ``start``), and say so (``strict=True``: raise
    :class:`CacheLeakError` after releasing); returns the holds released. ``where`` names the step in
    the report."""
    end = cache.counter()
    if end <= 0:  # nothing held (torch's parametrize not imported: 0)
        return 0
    from bnb_gc_fix.release import left_text, release_left_behind  # imports torch, which holds something

    found = release_left_behind(end - start)
    if not found.released and not found.left:
        return 0
    message = (
        f"bnb_gc_fix.guard: the parametrization cache counter went from {start} to {end} during {where} "
        f"({found.cached_bytes} bytes cached); released {found.released} holds left by calls that ended"
    )
    if found.left:
        message += f"; {left_text(found.left)}"
    message += f". Cause: {cache.CAUSE}."
    logger.warning(message)
    if strict:
        raise CacheLeakError(message, found.released, found.cached_bytes)
    warn(message, CacheLeakWarning, every_time=True)
    return found.released


class _Entries(threading.local):
    """One thread's counters at the entries of a guard it has not left yet, the innermost last."""

    def __init__(self) -> None:  # runs once in every thread that uses the guard, at its first use
        self.starts: list[int] = []


class guard(contextlib.ContextDecorator):  # noqa: N801  (used like a function: `with guard():`)
    """Around one training step (``with`` or decorator), outside torch.compile: ``guard()(compiled)``
    guards a compiled step. On exit, :func:`check_and_release` of what it added (``strict`` only when no
    exception leaves the step, which the guard's own report never replaces). One guard may serve
    several threads at once (a decorated step)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._entries = _Entries()

    def __enter__(self) -> guard:
        self._entries.starts.append(cache.counter())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        start = self._entries.starts.pop()
        try:
            check_and_release(strict=self.strict and exc_type is None, start=start)
        except Exception:  # the report, as an error (-W error): never in place of the step's own
            if exc_type is None:
                raise
