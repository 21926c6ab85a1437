"""A notebook cell's span, and its one rule: switch off only what is provably the span's own, and report
the rest.

A span runs on one thread. What it switches off when it ends are the switch-ons that the fix's forwards
made on that thread inside the span and that are still on: every call that started there has returned or
unwound by then, so those were left by a ``BaseException`` that is not an ``Exception``
(``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``), for which torch runs no forward hook. Nothing
else is switched off: another thread's, ``P.cached()`` blocks, the libraries' own hooks (the fix off, or
not needed), those from before the span. Where the cache is still on, the report says what may keep it on.
"""

from __future__ import annotations

from dataclasses import dataclass

from bnb_gc_fix import cache, ledger
from bnb_gc_fix.lines import counted, message


@dataclass(frozen=True)
class Span:
    """Where a span began: the last ticket given out, and torch's counter."""

    ticket: int
    counter: int

    @classmethod
    def begin(cls) -> Span:
        return cls(ticket=next(ledger.tickets), counter=cache.counter())

    def end(self) -> Ending:
        """Switch off this thread's switch-ons made in the span, and say what is still on."""
        cached = cache.cached_bytes()
        switched_off = ledger.switch_off_since(self.ticket)
        counter = cache.counter()
        return Ending(switched_off, counter, max(counter - self.counter, 0), cached)


@dataclass(frozen=True)
class Ending:
    """What a span found when it ended."""

    switched_off: int  # the fix's switch-ons made in the span on its thread, left by a BaseException
    counter: int  # torch's counter once those were switched off
    left: int  # how far the counter still stands above where it stood when the span began
    cached_bytes: int  # what the cache held before anything was switched off

    @property
    def clean(self) -> bool:
        return self.switched_off == 0 and self.left == 0

    def report(self, who: str, where: str) -> str:
        """The report of a span that did not end clean, in words the user can act on, in lines of at most
        100 characters: what ``where`` (this cell) left, what ``who`` did, and what is still on."""
        from bnb_gc_fix.status import status  # not at the top: status imports what imports this module

        parts = []
        if self.switched_off:
            forwards = counted(self.switched_off, "forward")
            pronoun = "that" if self.switched_off == 1 else "those"
            parts.append(
                f"{forwards} in {where} switched the cache on and stopped before switching it off (by "
                "KeyboardInterrupt, SystemExit or another BaseException that is not an Exception: torch runs "
                f"no forward hook then). bnb-gc-fix switched {pronoun} off."
            )
        if self.counter == 0:
            parts.append(f"The cache is off and empty now ({self.cached_bytes} bytes were cached).")
        else:
            above = f", {self.left} above where it was when {where} began" if self.left else ""
            keeping = status().who_keeps_it_on()
            parts.append(f"The cache is still on (counter {self.counter}{above}): {keeping}.")
        return message(f"{who}: {where} left the cache switched on.", " ".join(parts))
