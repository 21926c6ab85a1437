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

from bnb_gc_fix.errors import CacheLeakError, CacheLeakWarning

logger = logging.getLogger("bnb_gc_fix")

_PARAMETRIZE = "torch.nn.utils.parametrize"
_CAUSE = (
    "usually a forward interrupted by an exception that skipped a forward hook: non-reentrant "
    "activation checkpointing on bitsandbytes 0.48-0.49, or a KeyboardInterrupt"
)
_F = TypeVar("_F", bound=Callable[..., Any])


def counter_now() -> int:
    """torch's parametrization cache counter, 0 while torch's parametrize module is not imported."""
    module = sys.modules.get(_PARAMETRIZE)
    return int(getattr(module, "_cache_enabled", 0) or 0) if module is not None else 0


def check_and_release(strict: bool = False, start: int = 0) -> int:
    """Release what the step left switched on, and say so.

    ``start`` is the counter when the step began: only holds added since then, and owned by no
    call still running on any thread, are released (see :func:`bnb_gc_fix.gate.release_left_behind`),
    so a ``P.cached()`` block of another thread is never cut short. Returns the holds released (0
    when nothing was left behind, and then it is silent). With ``strict=True`` it raises
    :class:`CacheLeakError` after releasing.
    """
    if _PARAMETRIZE not in sys.modules:
        return 0
    end = counter_now()
    if end <= start or end <= 0:
        return 0
    from bnb_gc_fix import gate

    cached = gate.cached_bytes()
    released = gate.release_left_behind(end - start)
    if not released:
        return 0
    message = (
        f"bnb_gc_fix.guard: the parametrization cache counter went from {start} to {end} during the "
        f"step and {released} of those holds belonged to no running call ({cached} bytes cached); "
        f"released them. Cause: {_CAUSE}."
    )
    logger.warning(message)
    if strict:
        raise CacheLeakError(message, released, cached)
    warnings.warn(message, CacheLeakWarning, stacklevel=3)
    return released


class guard(contextlib.ContextDecorator):  # noqa: N801  (used like a function: `with guard():`)
    """Context manager and decorator around one training step.

    On exit, if the step left torch's parametrization cache counter higher than it found it, the
    holds that no running call owns are released, logged, and reported with one
    :class:`CacheLeakWarning`; with ``strict=True`` a :class:`CacheLeakError` is raised instead,
    after releasing. Silent when nothing is left behind. An exception leaving the step is never
    replaced by ours.

    As a decorator of a function that ``torch.compile`` compiles (also with ``fullgraph=True``),
    the check runs around the compiled call, outside the trace.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._starts: list[int] = []

    def __enter__(self) -> guard:
        self._starts.append(counter_now())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        start = self._starts.pop() if self._starts else 0
        check_and_release(strict=self.strict and exc_type is None, start=start)

    def __call__(self, function: _F) -> _F:
        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return cast(_F, _outside_traces(guarded))


def _outside_traces(function: _F) -> _F:
    """Let Dynamo skip this one frame (the guard's ``with``) and still compile what it calls.

    Without it, ``torch.compile(guard()(step), fullgraph=True)`` fails: Dynamo cannot trace the
    guard's context manager. Only where torch is already imported (this never imports it), so a
    step decorated before ``import torch`` gets a plain wrapper.
    """
    if "torch" not in sys.modules:
        return function
    try:
        from torch._dynamo.decorators import skip

        return cast(_F, skip(function))
    except Exception:  # a torch without Dynamo: nothing to keep out
        return function
