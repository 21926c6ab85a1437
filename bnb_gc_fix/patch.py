"""The patch: wrapt wrappers around a target library's functions (:mod:`bnb_gc_fix.targets`). The
registering function runs in full, then the plain pair it added is swapped for the gate; the enable
function, met as the pre-hook of a module still holding a plain pair (loaded from a pickle), turns it
into the gate at its first forward; a clamped disable function never drives the counter below zero.
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


def _wrappers(module: ModuleType, target: Target, force: bool = False) -> dict[str, _WrapperFunction]:
    def register(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        quantized = args[0] if args else kwargs.get("module")
        try:
            if quantized is not None:
                gate.install(quantized, replace_always_called=force)
        except Exception:  # never break the user's quantization call
            logger.exception("could not install the cache gate on %s", type(quantized).__name__)
        return result

    def enable(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            if args and gate.convert_at_forward(args[0], force):
                return None
        except Exception:  # never break the user's forward: the plain hook runs as it is
            logger.exception("could not install the cache gate on %s", type(args[0]).__name__)
        return wrapped(*args, **kwargs)

    wrappers: dict[str, _WrapperFunction] = {target.register: register}
    if hasattr(module, gate.ENABLE_NAME):
        wrappers[gate.ENABLE_NAME] = enable
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
