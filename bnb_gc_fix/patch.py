"""Putting the fix into a library's module: its pair of hook functions gets the fix's code, and its register
function covers each module it quantizes.

The two hook functions keep their identity, so a pickle names them as before and every module that holds
them, quantized before the fix turned on or after, runs the fix: what changes is their code
(``__code__``, ``__defaults__`` and ``__kwdefaults__``, which Python lets a program replace) for
``bnb_gc_fix.hooks``'s. Their ``__signature__`` keeps the library's own, for ``inspect.signature`` and
``help()``. The register function
is wrapped (wrapt), so that each module it quantizes is covered at once. Nothing is ever put back: a
process that must run the library's own code starts with ``BNB_GC_FIX=0``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import wrapt

from bnb_gc_fix import cover, hooks, reading
from bnb_gc_fix.libraries import Library

#: What the wrapper does once the library's register function returned on the first real module: decide
#: from what it registered there.
Decide = Callable[[reading.Reading], None]


class _RegisterWrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """The fix's wrapper of a register function; ``_self_decide`` (wrapt keeps ``_self_`` names on the
    wrapper itself) is the decision still to make from its first real module, if any."""

    _self_decide: Decide | None


def own_register(module: ModuleType, library: Library) -> Any:
    """The library's register function itself, never the fix's wrapper of it (None: it has none)."""
    register = getattr(module, library.register_name, None)
    if isinstance(register, _RegisterWrapper):
        return register.__wrapped__
    return register


def wrap_register(module: ModuleType, library: Library, decide: Decide | None) -> None:
    """Wrap the module's register function (once): each module it quantizes is covered; with ``decide``,
    what it registers on the first real module it is called on goes to ``decide`` first."""
    register = getattr(module, library.register_name)
    if isinstance(register, _RegisterWrapper):
        register._self_decide = decide
        return

    def register_and_cover(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        quantized = args[0] if args else kwargs.get("module")
        before = _hooks_before(quantized, library) if wrapper._self_decide is not None else None
        result = wrapped(*args, **kwargs)
        if before is not None:
            _decide_from(wrapper, quantized, before, library)
        cover.cover(quantized)  # never raises: what is not a module is left as it is
        return result

    wrapper = _RegisterWrapper(register, register_and_cover)
    wrapper._self_decide = decide
    setattr(module, library.register_name, wrapper)


def unwrap_register(module: ModuleType, library: Library) -> None:
    """Give the module back its own register function, where the fix wrapped it."""
    register = getattr(module, library.register_name, None)
    if isinstance(register, _RegisterWrapper):
        setattr(module, library.register_name, register.__wrapped__)


def _hooks_before(quantized: Any, library: Library) -> reading.Hooks | None:
    """The hooks of what the register function is about to be called on (None: not a module, or hooks
    that cannot be read: then the next module decides). Never raises into the user's quantizing call."""
    if not isinstance(quantized, torch.nn.Module):
        return None
    try:
        return reading.Hooks.of(quantized, library.module_name)
    except Exception:  # hook dictionaries that do not look as torch's
        return None


def _decide_from(wrapper: _RegisterWrapper, quantized: Any, before: reading.Hooks, library: Library) -> None:
    """Hand what the register function registered on a real module to the pending decision, unless it
    registered nothing on a module it had quantized before: then the next module decides. Never raises
    into the user's quantizing call (the decision warns instead)."""
    decide = wrapper._self_decide
    try:
        what = reading.read(library, quantized, before)
    except Exception:  # hook dictionaries that do not look as torch's: the next module decides
        return
    if decide is None or what is None:
        return
    wrapper._self_decide = None
    decide(what)


def apply(pair: tuple[Any, Any], library: Library) -> None:
    """Give the library's pair of hook functions the fix's code, keeping their own signatures (once)."""
    fixes = (hooks.pre_hook_code, hooks.off_hook_code)
    for function, its_fix in zip(pair, fixes):
        if function.__code__ is its_fix.__code__:
            continue
        function.__signature__ = inspect.signature(function)
        function.__code__ = its_fix.__code__
        function.__defaults__ = its_fix.__defaults__  # None: every bound name is keyword-only
        function.__kwdefaults__ = its_fix.__kwdefaults__
    cover.FIXED_PAIRS[pair] = library.name
