"""The code a library's two hook functions get once the fix is in them (``bnb_gc_fix.patch``).

The functions keep their identity: only their ``__code__``, ``__defaults__`` (none) and ``__kwdefaults__``
become these. They run with the library's module as their globals, so every name they use, builtins too,
comes through a keyword-only default, bound here (tests/test_hooks.py checks that they load no global):
called with an argument too many, they raise ``TypeError`` as the library's own do. ``inspect.signature``
and ``help()`` show the library's own signature, kept in ``__signature__``.

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


def covered_or_switched_on(module: Any) -> bool:
    """A pre-hook's call on a module not covered yet: cover it and return True (the pre-hook then switches
    the cache on as for every covered module); else add 1, as the library's own pre-hook does, and return
    False: a module the fix cannot cover (another tool's function in front of its pre-hook) runs the
    library's own arithmetic, and so does a module of no library's (the function called directly)."""
    if cover.cover(module):
        return True
    P._cache_enabled += 1
    return False


def nested_or_switched_off(module: Any) -> bool:
    """A pre-hook's call on a module whose switch-on on this thread is still recorded. Where another call of
    the module runs further out on this thread (it calls itself), this call nests in that one: the cache
    stays on for it, unchanged, and True is returned. Else the switch-on is left over (by a Ctrl-C, or by
    a second pre-hook of this same call): it is switched off, False is returned, and the pre-hook
    switches the cache on anew. Inside a torch.compile trace, which reads no frame, always the latter (a
    call of itself then unpacks its weights again)."""
    key = id(module)
    switch_ons = ledger.local.switch_ons
    nested = not _compiling() and ledger.outer_call_running(module)  # a trace reads no frame
    if nested:
        switch_ons.nest(key)
        return True
    cache.switch_off(P, 1)
    switch_ons.outer.pop(key, None)
    return False


def without_a_switch_on(module: Any) -> None:
    """An off hook's call with no switch-on of this call's on this thread. A call nested in another of the
    module ends: the outer call's switch-on stays on for it. A module the fix does not cover runs the
    library's own arithmetic (its pre-hooks added 1: a module the fix cannot cover, a forward begun before
    the fix went in, or the function called directly); of those not found uncoverable, not where an off
    hook of it is marked always called (a deep copy of a covered module, not covered yet). A covered
    module: nothing, since what is on is not this call's (an earlier pre-hook raised, or it was switched
    off early)."""
    key = id(module)
    nested_call_ended = ledger.local.switch_ons.unnest(key)
    if nested_call_ended or key in cover.covered_ids():
        return
    if not cover.is_uncoverable(module) and not cover.off_hooks_all_plain(module):
        return
    P._cache_enabled -= 1
    if not P._cache_enabled:
        P._cache = {}


def pre_hook(
    module: Any,
    inputs: Any,
    *,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _id: Callable[[object], int] = id,
    _next: Callable[[Iterator[int]], int] = next,
    _local: Any = ledger.local,
    _covered: dict[int, Any] = cover.covered_ids(),  # noqa: B008 (bound once, on purpose)
    _tickets: Iterator[int] = ledger.tickets,
    _compiled: int = ledger.COMPILED,
    _compiling: Callable[[], bool] = _compiling,
    _cover_or_switch_on: Callable[[Any], bool] = covered_or_switched_on,
    _nested_or_switched_off: Callable[[Any], bool] = nested_or_switched_off,
) -> None:
    """The pre-hook: switch the cache on for the module on this thread, covering the module first if that
    is still to do; a module entered again on this thread goes to ``nested_or_switched_off``."""
    key = _id(module)
    if key not in _covered:
        covered = _cover_or_switch_on(module)
        if not covered:
            return
    switch_ons = _local.switch_ons
    if key in switch_ons:  # entered again on this thread
        nested = _nested_or_switched_off(module)
        if nested:
            return
    switch_ons[key] = _compiled if _compiling() else _next(_tickets)
    _P._cache_enabled += 1


def off_hook(
    module: Any,
    inputs: Any,
    output: Any,
    *,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _id: Callable[[object], int] = id,
    _local: Any = ledger.local,
    _without_a_switch_on: Callable[[Any], None] = without_a_switch_on,
) -> None:
    """The off hook, always called on a covered module: switch off this thread's switch-on for the module
    (``without_a_switch_on`` where this call has none: it nests in another, or its pre-hook never ran).
    The switch-off is ``cache.switch_off(_P, 1)`` written out, a call fewer on every forward."""
    key = _id(module)
    switch_ons = _local.switch_ons
    if not switch_ons.get(key):  # none, or NESTED
        _without_a_switch_on(module)
        return
    remaining = _P._cache_enabled - 1
    if remaining > 0:
        _P._cache_enabled = remaining
    else:  # never below 0, and the cache emptied at 0
        _P._cache_enabled = 0
        _P._cache = {}
    switch_ons.pop(key, None)  # reset() on another thread may have forgotten it meanwhile
