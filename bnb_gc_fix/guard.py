"""The leak guard: an explicit check around one training step, whether or not the fix is active."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar, cast

import _bnb_gc_fix_cache as cache
from bnb_gc_fix.errors import CacheLeakError, CacheLeakWarning

logger = logging.getLogger("bnb_gc_fix")
_F = TypeVar("_F", bound=Callable[..., Any])


def check_and_release(strict: bool = False, start: int = 0) -> int:
    """Release the holds added since the counter was ``start`` that no running call owns, and say so
    (``strict=True``: raise :class:`CacheLeakError` after releasing); returns the holds released."""
    end = cache.counter()
    if end <= max(start, 0):  # nothing added, or nothing held (torch's parametrize not imported: 0)
        return 0
    from bnb_gc_fix.release import release_left_behind  # imports torch, which holds something now

    cached = cache.cached_bytes()
    released = release_left_behind(end - start)
    if not released:
        return 0
    message = (
        f"bnb_gc_fix.guard: the parametrization cache counter went from {start} to {end} during the "
        f"step and {released} of those holds belonged to no running call ({cached} bytes cached); "
        f"released them. Cause: {cache.CAUSE}."
    )
    logger.warning(message)
    if strict:
        raise CacheLeakError(message, released, cached)
    warnings.warn(message, CacheLeakWarning, stacklevel=3)
    return released


class guard(contextlib.ContextDecorator):  # noqa: N801  (used like a function: `with guard():`)
    """Around one training step (``with`` or decorator, outside any torch.compile trace): on exit,
    :func:`check_and_release` of what it added (``strict`` only when no exception leaves the step)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._starts: list[int] = []

    def __enter__(self) -> guard:
        self._starts.append(cache.counter())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        check_and_release(strict=self.strict and exc_type is None, start=self._starts.pop())

    def __call__(self, function: _F) -> _F:
        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        # Dynamo skips this one frame (the `with`, which it cannot trace) and still compiles what it
        # calls; only where torch is already imported (this never imports it).
        if "torch" in sys.modules:
            with contextlib.suppress(Exception):  # a torch without Dynamo: nothing to keep out
                from torch._dynamo.decorators import skip

                return cast(_F, skip(guarded))
        return cast(_F, guarded)
