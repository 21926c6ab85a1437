"""The patch: wrapt wrappers around a target library's functions (see :mod:`bnb_gc_fix.targets`).

* The registering function still runs in full; then the plain pair it added is swapped for the gate.
* The enable function, met as the pre-hook of a module that still holds a plain pair (loaded from a
  pickle, whose hooks pickle as the plain pair), turns that pair into the gate at its first forward.
* The clamped disable function, if the target names one, never drives the counter below zero.

:func:`remove` puts the library's own functions back.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

from bnb_gc_fix import gate
from bnb_gc_fix.targets import BITSANDBYTES, Target

if TYPE_CHECKING:
    from collections.abc import Callable

    _WrapperFunction = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]

logger = logging.getLogger("bnb_gc_fix")


class _Wrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """Marks our wrappers, so applying twice wraps once and removing unwraps only ours."""


def _register_wrapper(replace_always_called: bool) -> _WrapperFunction:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        module = args[0] if args else kwargs.get("module")
        try:
            if module is not None:
                gate.install(module, replace_always_called=replace_always_called)
        except Exception:  # never break the user's quantization call
            logger.exception("could not install the cache gate on %s", type(module).__name__)
        return result

    return wrapper


def _enable_wrapper(replace_always_called: bool) -> _WrapperFunction:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            if args and gate.convert_at_forward(args[0], replace_always_called):
                return None
        except Exception:  # never break the user's forward: the plain hook runs as it is
            logger.exception("could not install the cache gate on %s", type(args[0]).__name__)
        return wrapped(*args, **kwargs)

    return wrapper


def _wrappers(
    module: ModuleType, target: Target, replace_always_called: bool = False
) -> dict[str, _WrapperFunction]:
    wrappers = {target.register: _register_wrapper(replace_always_called)}
    if hasattr(module, gate.ENABLE_NAME):
        wrappers[gate.ENABLE_NAME] = _enable_wrapper(replace_always_called)
    if target.clamp is not None:
        wrappers[target.clamp] = gate.clamped_disable
    return wrappers


def is_applied(module: ModuleType, target: Target = BITSANDBYTES) -> bool:
    """Whether our wrappers are on the target's module right now."""
    return all(isinstance(getattr(module, name, None), _Wrapper) for name in _wrappers(module, target))


def apply(module: ModuleType, target: Target = BITSANDBYTES, replace_always_called: bool = False) -> None:
    """Wrap the target's functions, once. ``replace_always_called`` (force): the gate also replaces pairs
    whose disable hook is already always-called."""
    for name, wrapper in _wrappers(module, target, replace_always_called).items():
        current = getattr(module, name)
        if not isinstance(current, _Wrapper):  # applying twice wraps once
            setattr(module, name, _Wrapper(current, wrapper))


def remove(module: ModuleType, target: Target = BITSANDBYTES) -> None:
    """Put the library's own functions back (only ours are unwrapped)."""
    for name in _wrappers(module, target):
        current = getattr(module, name, None)
        if isinstance(current, _Wrapper):
            setattr(module, name, current.__wrapped__)
