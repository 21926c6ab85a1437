"""The leak guard: an explicit check around one training step, whether or not the fix is active."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from types import TracebackType

from bnb_gc_fix.errors import CacheLeakError, CacheLeakWarning

logger = logging.getLogger("bnb_gc_fix")

_CAUSE = (
    "usually a forward interrupted by an exception that skipped a forward hook: non-reentrant "
    "activation checkpointing on bitsandbytes 0.48-0.49, or a KeyboardInterrupt"
)


def check_and_release(strict: bool = False) -> int:
    """If torch's parametrization cache is still switched on, release it and say so.

    Returns the holds released (0 when nothing was stuck, and then it is silent). With
    ``strict=True`` it raises :class:`CacheLeakError` after releasing.
    """
    if "torch.nn.utils.parametrize" not in sys.modules:
        return 0
    from bnb_gc_fix import gate

    if gate.counter() == 0:
        return 0
    cached = gate.cached_bytes()
    released = gate.reset()
    if not released:
        return 0
    message = (
        f"bnb_gc_fix.guard: the parametrization cache was still switched on after the step "
        f"(counter {released}, {cached} bytes cached); released it. Cause: {_CAUSE}."
    )
    logger.warning(message)
    if strict:
        raise CacheLeakError(message, released, cached)
    warnings.warn(message, CacheLeakWarning, stacklevel=3)
    return released


class guard(contextlib.ContextDecorator):  # noqa: N801  (used like a function: `with guard():`)
    """Context manager and decorator around one training step.

    On exit, if the parametrization cache counter is not back to zero, it is released (as
    :func:`bnb_gc_fix.reset`), logged, and reported with one :class:`CacheLeakWarning`; with
    ``strict=True`` a :class:`CacheLeakError` is raised instead, after releasing. Silent when
    nothing is stuck. An exception leaving the step is never replaced by ours.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def __enter__(self) -> guard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        check_and_release(strict=self.strict and exc_type is None)
