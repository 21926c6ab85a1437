"""The code a library's two hook functions get once the fix is in them (``bnb_gc_fix.patch``).

The functions keep their identity: only their ``__code__``, ``__defaults__`` (none) and ``__kwdefaults__``
become these. They run
with the library's module as their globals, so every name they use comes through a keyword-only default,
bound here (tests/test_gate.py checks that they load no global): called with an argument too many, they
raise ``TypeError`` as the library's own do. ``inspect.signature`` and ``help()`` show the library's own
signature, kept in ``__signature__``.

A thread's record never counts fewer switch-ons than its share of the counter: an entry is made before the
counter is raised and dropped after it is lowered (``bnb_gc_fix.ledger``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.utils.parametrize as P

from bnb_gc_fix import cache, cover, ledger


def _never_compiling() -> bool:  # a torch without torch.compiler.is_dynamo_compiling (before 2.3)
    return False


#: True while Dynamo traces the caller (it reads it as a constant), False when the code runs.
_compiling = getattr(torch.compiler, "is_dynamo_compiling", _never_compiling)


def _ticket() -> int:
    """The next ticket; 0 inside a torch.compile trace (Dynamo would compile anew for each ticket). The
    pre-hook's fast path writes this out, with no call."""
    return 0 if _compiling() else next(ledger.tickets)


def covered_or_switched_on(module: Any) -> bool:
    """A pre-hook's call on a module not covered yet: cover it and return True (the pre-hook then switches
    the cache on as for every covered module); else switch the cache on here and return False. A module
    the fix cannot cover (it holds a fixed off hook behind another tool's pre-hook) has each call recorded
    as a switch-on of its own, which one of its off hooks switches off; a module of no library's (the
    function called directly) gets 1 added, as the library's own pre-hook adds it."""
    if cover.cover(module):
        return True
    if cover.is_uncoverable(module):
        ledger.uncovered_switch_on(id(module), _ticket())
    P._cache_enabled += 1
    return False


def switch_off_uncovered(module: Any) -> None:
    """An off hook's call with no switch-on of the module's as covered: switch off the latest one recorded
    for it as a module the fix cannot cover. With none, where the fix records nothing of the module and
    none of its fixed off hooks is marked always called, its pre-hooks ran the library's own +1 (a forward
    begun before the fix went in, or the function called directly): switch that off, as the library's own
    off hook would (torch calls a plain hook only after the forward and its pre-hooks ran). Otherwise
    nothing: what is on is not this call's (an earlier pre-hook raised, or it was switched off early)."""
    if ledger.uncovered_switch_off(id(module)):
        return
    if cover.is_recorded(module) or not cover.off_hooks_all_plain(module):
        return
    cache.switch_off(P, 1)


def pre_hook_code(
    module: Any,
    inputs: Any,
    *,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _local: Any = ledger.local,
    _covered: dict[int, Any] = cover.covered_ids(),  # noqa: B008 (bound once, on purpose)
    _tickets: Iterator[int] = ledger.tickets,
    _compiling: Callable[[], bool] = _compiling,
    _cover_or_switch_on: Callable[[Any], bool] = covered_or_switched_on,
    _switch_off: Callable[[Any, int], None] = cache.switch_off,
) -> None:
    """The pre-hook: switch the cache on for the module on this thread, covering the module first if that
    is still to do. A switch-on made in a torch.compile trace has ticket 0 (Dynamo would compile anew for
    each ticket): no notebook cell switches it off; the module's next forward does."""
    key = id(module)
    if key not in _covered:
        covered = _cover_or_switch_on(module)
        if not covered:
            return
    switch_ons = _local.switch_ons
    if key in switch_ons:  # entered again on this thread: its last call left by Ctrl-C, or it calls itself
        _switch_off(_P, 1)  # (a call of itself then reads its weights again: never a leak)
    switch_ons[key] = 0 if _compiling() else next(_tickets)
    _P._cache_enabled += 1


def off_hook_code(
    module: Any,
    inputs: Any,
    output: Any,
    *,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _local: Any = ledger.local,
    _switch_off_uncovered: Callable[[Any], None] = switch_off_uncovered,
) -> None:
    """The off hook, always called on a covered module: switch off this thread's switch-on for the module
    (``switch_off_uncovered`` where it has none). The switch-off is ``cache.switch_off(_P, 1)`` written
    out: a call costs a small module's forward about 3% more (benchmarks/hotpath.py)."""
    key = id(module)
    switch_ons = _local.switch_ons
    if key not in switch_ons:
        _switch_off_uncovered(module)
        return
    remaining = _P._cache_enabled - 1
    if remaining > 0:
        _P._cache_enabled = remaining
    else:  # never below 0, and the cache emptied at 0
        _P._cache_enabled = 0
        _P._cache = {}
    switch_ons.pop(key, None)  # reset() on another thread may have forgotten it meanwhile
