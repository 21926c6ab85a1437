"""The patch: wrapt wrappers around the functions of a library's module (``_bnb_gc_fix.LIBRARIES``).

* The registering function runs in full; then the plain pair it added is swapped for the gate.
* The enable function, met as the pre-hook of a module still holding a plain pair (a module loaded
  from a pickle, or quantized before the fix was active), turns that pair into the gate at its first
  forward, and the gate takes that forward's hold.
* The disable function, called directly, never drives the counter below zero.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import wrapt

import _bnb_gc_fix as words
from _bnb_gc_fix import cache
from bnb_gc_fix import gate, hooks

if TYPE_CHECKING:
    from collections.abc import Callable

    _WrapperFunction = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]

logger = logging.getLogger("bnb_gc_fix")


class _Wrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """Marks our wrappers, so applying twice wraps once and removing unwraps only ours."""


def _gated_at_forward(module: object, replace_always_called: bool) -> bool:
    """Called as the pre-hook of ``module``: turn its plain pairs into a gate.

    Returns True when the wrapped enable function must not take a hold: the gate took this forward's
    (the module was converted just now), or the module was gated already. Then this call comes from a
    plain pair registered beside the gate (``install`` folds it into the gate now; the gate's own
    pre-hook, earlier in the same snapshot of pre-hooks, took the hold), or from the snapshot of
    pre-hooks torch took before another pair of this module was converted in this forward (whose
    conversion took the hold). False when it should run as it is: not a module, or nothing to convert.
    Whether the module was gated is read before ``install`` changes it.

    The conversion takes this forward's hold through the gate's pre-hook, which notes this function's
    frame: it ends at once, so a self-call inside this one forward gives that hold back (one forward
    that dequantizes more, never a leak).
    """
    if not isinstance(module, torch.nn.Module):
        return False
    gated = gate.Gate.of(module) is not None
    changed = hooks.install(module, replace_always_called)
    if gated:
        return True
    if not changed:
        return False
    enter = gate.enter_hook(module)
    if enter is None:
        raise LookupError(f"no gate on {type(module).__name__} after installing one")
    enter(module, ())
    return True


def _clamped_disable(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A disable function that never goes below zero, and empties the cache at zero."""
    if cache.counter() > 0:
        return wrapped(*args, **kwargs)
    cache.give_back(0)
    return None


def _register_wrapper(force: bool) -> _WrapperFunction:
    """The wrapper of a register function: register as the library does, then put the gate in place."""

    def register(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        quantized = args[0] if args else kwargs.get("module")
        if quantized is None:
            return result
        try:
            hooks.install(quantized, replace_always_called=force)
        except Exception:  # never break the user's quantization call
            logger.exception("could not install the cache gate on %s", type(quantized).__name__)
        return result

    return register


def _enable_wrapper(force: bool) -> _WrapperFunction:
    """The wrapper of an enable function: met as a plain pair's pre-hook, it converts the pair."""

    def enable(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        converted = False
        if args:
            try:
                converted = _gated_at_forward(args[0], force)
            except Exception:  # never break the user's forward: the plain hook runs as it is
                logger.exception("could not install the cache gate on %s", type(args[0]).__name__)
        if converted:
            return None
        return wrapped(*args, **kwargs)

    return enable


def _wrappers(library: words.Facts, force: bool) -> dict[str, _WrapperFunction]:
    """The wrapper function for each of the library's functions, by name."""
    return {
        library.register: _register_wrapper(force),
        words.ENABLE_HOOK: _enable_wrapper(force),
        words.DISABLE_HOOK: _clamped_disable,
    }


def is_applied(module: ModuleType, library: words.Facts) -> bool:
    """Whether our wrappers are on the library's module right now."""
    names = _wrappers(library, force=False)
    return all(isinstance(getattr(module, name, None), _Wrapper) for name in names)


def apply(module: ModuleType, library: words.Facts, replace_always_called: bool = False) -> None:
    """Wrap the library's functions, once. ``replace_always_called`` (force): the gate also replaces
    pairs whose disable hook is already always-called."""
    for name, wrapper in _wrappers(library, replace_always_called).items():
        current = getattr(module, name)
        if not isinstance(current, _Wrapper):  # applying twice wraps once
            setattr(module, name, _Wrapper(current, wrapper))


def remove(module: ModuleType, library: words.Facts) -> None:
    """Put the library's own functions back (only ours are unwrapped)."""
    for name in _wrappers(library, force=False):
        current = getattr(module, name, None)
        if isinstance(current, _Wrapper):
            setattr(module, name, current.__wrapped__)
