"""The patch: wrapt wrappers around the functions of a library's module (``_bnb_gc_fix.LIBRARIES``).

* The registering function runs in full; then the plain pair it added is swapped for the gate.
* The enable function, met as the pre-hook of a module still holding a plain pair (a module loaded
  from a pickle, whose hooks are the module's functions by name), turns that pair into the gate at its
  first forward, and the gate takes that forward's hold. A module quantized before the fix was active
  holds the library's own function objects, which no wrapper reaches: ``repair()`` is for those.
* The disable function, called directly, never drives the counter below zero.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import wrapt

import _bnb_gc_fix as words
from _bnb_gc_fix import cache
from bnb_gc_fix import activation, gate, hooks
from bnb_gc_fix.errors import logger

if TYPE_CHECKING:
    from collections.abc import Callable

    _WrapperFunction = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]


class _Wrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """Marks our wrappers, so applying twice wraps once and removing unwraps only ours."""


def _gate_takes_this_forward(module: object) -> bool:
    """Called as the pre-hook of ``module``: turn its plain pairs into a gate, and say whether the
    wrapped enable function must not take a hold (True) or run as it is (False: not a module, or
    nothing of a gate's on it).

    A module gated already: this call comes from a plain pair registered beside the gate (``install``
    folds it in now), or from the snapshot of pre-hooks torch took before the module was converted in
    this forward, by another pair of it or by another thread; the hold was taken, or this one forward
    runs without the cache. A module gated just now: the gate takes this forward's hold, through its
    pre-hook, which notes this function's frame; that frame ends at once, so a self-call inside this
    one forward gives the hold back (more dequantization in that forward, never a leak).
    """
    if not isinstance(module, torch.nn.Module):
        return False
    with hooks.lock:
        gated_before = gate.Gate.of(module) is not None
        hooks.install(module, activation.forcing())
        enter = gate.enter_hook(module)
    if enter is None:
        return False
    if not gated_before:
        enter(module, ())
    return True


def _clamped_disable(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A disable function that never goes below zero, and empties the cache at zero."""
    if cache.counter() > 0:
        return wrapped(*args, **kwargs)
    cache.empty_at_zero()
    return None


def _register(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper of a register function: register as the library does, then put the gate in place."""
    result = wrapped(*args, **kwargs)
    quantized = args[0] if args else kwargs.get("module")
    if quantized is None:
        return result
    try:
        hooks.install(quantized, replace_always_called=activation.forcing())
    except Exception:  # never break the user's quantization call
        logger.exception("could not install the cache gate on %s", type(quantized).__name__)
    return result


def _enable(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapper of an enable function: met as a plain pair's pre-hook, it converts the pair."""
    module = args[0] if args else None
    try:
        if _gate_takes_this_forward(module):
            return None
    except Exception:  # never break the user's forward; never a raw hold on a module a gate holds for
        logger.exception("could not install the cache gate on %s", type(module).__name__)
        if isinstance(module, torch.nn.Module) and gate.Gate.of(module) is not None:
            return None
    return wrapped(*args, **kwargs)


def _wrappers(library: words.Facts) -> dict[str, _WrapperFunction]:
    """The wrapper function for each of the library's functions, by name."""
    register, enable, disable = library.function_names
    return {register: _register, enable: _enable, disable: _clamped_disable}


def is_ours(function: object) -> bool:
    """Whether ``function`` is one of the fix's wrappers (``__wrapped__`` is the library's own)."""
    return isinstance(function, _Wrapper)


def is_applied(module: ModuleType, library: words.Facts) -> bool:
    """Whether our wrappers are on the library's module right now."""
    return all(is_ours(getattr(module, name, None)) for name in library.function_names)


def apply(module: ModuleType, library: words.Facts) -> None:
    """Wrap the library's functions, once (the gate also replaces pairs that are right already where
    the switch says ``force``, as read at each call)."""
    for name, wrapper in _wrappers(library).items():
        current = getattr(module, name)
        if not is_ours(current):  # applying twice wraps once
            setattr(module, name, _Wrapper(current, wrapper))


def remove(module: ModuleType, library: words.Facts) -> None:
    """Put the library's own functions back (only ours are unwrapped)."""
    for name in library.function_names:
        current = getattr(module, name, None)
        if isinstance(current, _Wrapper):
            setattr(module, name, current.__wrapped__)
