"""The code a library's two hook functions get once the fix is in them (``bnb_gc_fix.patch``).

The functions keep their identity: only their ``__code__`` and ``__defaults__`` become these. They run with
the library's module as their globals, so every name they use comes through a default argument, bound
here (tests/test_gate.py checks that they load no global). ``inspect.signature`` and ``help()`` show the
library's own signature, kept in ``__signature__``.

A thread's record never counts fewer switch-ons than its share of the counter: an entry is made before the
counter is raised and dropped after it is lowered, so a fork in between leaves the child one entry too many
(switched off clamped at 0), never a count nobody switches off.
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


def pre_hook_code(
    module: Any,
    inputs: Any,
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _local: Any = ledger.local,
    _covered: dict[int, Any] = cover.covered_ids(),  # noqa: B008 (bound once, on purpose)
    _tickets: Iterator[int] = ledger.tickets,
    _compiling: Callable[[], bool] = _compiling,
    _cover: Callable[[Any], bool] = cover.cover,
    _switch_off: Callable[[Any, int], None] = cache.switch_off,
) -> None:
    """The pre-hook: switch the cache on for the module on this thread, covering the module first if that
    is still to do. Called on a module of no library's (the function called directly), it adds 1 as the
    library's own pre-hook does. A switch-on made in a torch.compile trace has ticket 0 (Dynamo would
    compile anew for each ticket): no notebook cell switches it off; the module's next forward does."""
    key = id(module)
    if key not in _covered:
        recorded = _cover(module)
        if not recorded:
            _P._cache_enabled += 1  # as the library's own hook does; its off hook takes it off the same way
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
    _P: Any = P,  # noqa: N803 (torch's own name for the module)
    _local: Any = ledger.local,
    _all_plain: Callable[[Any], bool] = cover.off_hooks_all_plain,
    _switch_off: Callable[[Any, int], None] = cache.switch_off,
) -> None:
    """The off hook, always called on a covered module: switch off this thread's switch-on for the module.
    Without one (an earlier pre-hook raised, so the module's never ran; or it was switched off early)
    nothing is switched off, unless none of the module's off hooks is marked always called: its forward
    began before the fix covered it (or it cannot be covered), so its pre-hook took the library's own +1,
    which this switches off as the library's own off hook would (torch calls a plain one only after the
    forward and its pre-hooks ran). A covered module (its off hook marked) with another pair registered on
    it later, or a copy of one, never switches off what it did not switch on."""
    key = id(module)
    switch_ons = _local.switch_ons
    if key in switch_ons:
        _switch_off(_P, 1)
        switch_ons.pop(key, None)  # reset() on another thread may have forgotten it meanwhile
    elif _all_plain(module):
        _switch_off(_P, 1)
