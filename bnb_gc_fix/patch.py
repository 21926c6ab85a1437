"""The patch: wrapt wrappers around two functions of ``bitsandbytes.nn.parametrize``.

* ``_register_parametrization_hooks`` still runs (it also registers bitsandbytes' state-dict
  hook); afterwards the plain cache pair it added is swapped for the module's one gate.
* ``_disable_parametrization_cache`` can no longer drive the counter below zero when anything
  calls it directly, and it still empties the cache at zero.

Both are undone by :func:`remove`, which puts bitsandbytes' own functions back.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import wrapt

from bnb_gc_fix import gate

logger = logging.getLogger("bnb_gc_fix")

REGISTER = "_register_parametrization_hooks"
DISABLE = "_disable_parametrization_cache"


class _Wrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """Marks our wrappers, so applying twice wraps once and removing unwraps only ours."""


def _register_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    module = args[0] if args else kwargs.get("module")
    try:
        if module is not None:
            gate.install(module)
    except Exception:  # never break the user's quantization call
        logger.exception("could not install the cache gate on %s", type(module).__name__)
    return result


def _disable_wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return gate.clamped_disable(wrapped, args, kwargs)


_WRAPPERS = {REGISTER: _register_wrapper, DISABLE: _disable_wrapper}


def is_applied(parametrize: ModuleType) -> bool:
    """Whether our wrappers are on ``parametrize`` right now."""
    return all(isinstance(getattr(parametrize, name, None), _Wrapper) for name in _WRAPPERS)


def apply(parametrize: ModuleType) -> bool:
    """Wrap both functions; returns False when they were already wrapped (idempotent)."""
    if is_applied(parametrize):
        return False
    for name, wrapper in _WRAPPERS.items():
        current = getattr(parametrize, name)
        if not isinstance(current, _Wrapper):
            setattr(parametrize, name, _Wrapper(current, wrapper))
    return True


def remove(parametrize: ModuleType) -> bool:
    """Put bitsandbytes' own functions back; returns False when nothing was wrapped."""
    removed = False
    for name in _WRAPPERS:
        current = getattr(parametrize, name, None)
        if isinstance(current, _Wrapper):
            setattr(parametrize, name, current.__wrapped__)
            removed = True
    return removed
