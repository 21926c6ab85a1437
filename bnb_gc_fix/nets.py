"""The safety nets' one rule: give back only what is provably theirs, and report the rest.

A net spans a training step (``guard()``, the Trainer callback) or a notebook cell, on one thread. What it
gives back when its span ends are the holds that the fix's hooks took on that thread inside the span and
that are still held: every call that started there has returned or unwound by then, so those holds were
left by a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``,
``GeneratorExit``), for which torch runs no forward hook. Nothing else is given back: another thread's
holds, ``P.cached()`` blocks, bitsandbytes' own hooks (the fix off, or 0.50's), holds older than the span.
Where the counter still stands above where it stood when the span began, the net reports it, with what
to do.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from types import TracebackType

from bnb_gc_fix import cache
from bnb_gc_fix.errors import CacheLeakError, CacheLeakWarning, logger, warn
from bnb_gc_fix.lines import NOT_THE_FIXS, counted, message


@dataclass(frozen=True)
class Span:
    """Where a net's span began: the last hold ticket given out, and torch's counter."""

    ticket: int
    counter: int

    @classmethod
    def begin(cls) -> Span:
        gate = cache.gate_if_imported()
        ticket = 0 if gate is None else next(gate.tickets)
        return cls(ticket=ticket, counter=cache.counter())

    def end(self) -> Ending:
        """Give back this thread's holds taken in the span, and say what stays above the span's start."""
        cached = cache.cached_bytes()
        gate = cache.gate_if_imported()
        given = 0 if gate is None else int(gate.give_back_since(self.ticket))
        left = max(cache.counter() - self.counter, 0)
        return Ending(given_back=given, left=left, cached_bytes=cached)


@dataclass(frozen=True)
class Ending:
    """What a net found when its span ended."""

    given_back: int  # holds the fix's hooks took in the span on this thread, left by a BaseException
    left: int  # how far the counter still stands above where it stood when the span began
    cached_bytes: int  # what the cache held before anything was given back

    @property
    def clean(self) -> bool:
        return self.given_back == 0 and self.left == 0

    def report(self, who: str, where: str) -> str:
        """The report of a span that did not end clean, in words the user can act on, in lines of at most
        100 characters: ``who`` said what ``where`` (the step, this cell) left."""
        parts = []
        if self.given_back:
            parts.append(
                f"{counted(self.given_back, 'forward')} in {where} switched the cache on and stopped before "
                "switching it off (by KeyboardInterrupt, SystemExit or another BaseException that is not an "
                "Exception: torch runs no forward hook then). The fix switched it off "
                f"({self.cached_bytes} bytes were cached)."
            )
        if self.left:
            parts.append(
                f"The counter stays {self.left} above where it was when {where} began: {NOT_THE_FIXS}"
            )
        return message(f"{who}: {where} left the cache switched on.", " ".join(parts))

    def tell(self, who: str, where: str, strict: bool) -> None:
        """Log the report and warn (a :class:`CacheLeakWarning`); with ``strict``, raise a
        :class:`CacheLeakError` instead where the counter stays above where it was."""
        message = self.report(who, where)
        logger.warning("%s", message)
        if strict and self.left:
            raise CacheLeakError(message, self.left, self.cached_bytes)
        warn(message, CacheLeakWarning, every_time=True)


class _Spans(threading.local):
    def __init__(self) -> None:  # once in each thread, at its first use
        self.open: list[Span] = []  # the spans of guards this thread has entered and not left, innermost last


class LeakGuard(contextlib.ContextDecorator):
    """``bnb_gc_fix.guard()``: a safety net around a training step (``with``, or a decorator)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._spans = _Spans()

    def __enter__(self) -> LeakGuard:
        self._spans.open.append(Span.begin())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        ending = self._spans.open.pop().end()
        if ending.clean:
            return
        if kind is None:
            ending.tell("bnb_gc_fix.guard", "the step", self.strict)
            return
        with contextlib.suppress(Exception):  # the step's own exception goes on: the report never replaces it
            ending.tell("bnb_gc_fix.guard", "the step", strict=False)


def guard(strict: bool = False) -> LeakGuard:
    """A safety net around one training step: on exit, what the step left is given back as far as it is
    provably its own and reported (a :class:`CacheLeakWarning`); with ``strict=True``, a
    :class:`CacheLeakError` for what stays. With torch.compile, around the compiled step."""
    return LeakGuard(strict=strict)
