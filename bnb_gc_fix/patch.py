"""Putting the fix into a library's module: its register function covers each module it quantizes, and its
pair of hook functions gets the fix's code.

The two hook functions keep their identity, so a pickle names them as before and every module that holds
them, quantized before the fix turned on or after, runs the fix: what changes is their code
(``__code__``, ``__defaults__`` and ``__kwdefaults__``, which Python lets a program replace) for
``bnb_gc_fix.hooks``'s. Their ``__signature__`` keeps the library's own, for ``inspect.signature`` and
``help()``. The register function is wrapped (wrapt), so that each module it quantizes is covered at once.
Nothing is ever put back: a process that must run the library's own code starts with ``BNB_GC_FIX=0``.
"""

from __future__ import annotations

import inspect
from types import FunctionType, ModuleType
from typing import Any

import wrapt

from bnb_gc_fix import cover, hooks
from bnb_gc_fix.libraries import Library
from bnb_gc_fix.releases import version_of
from bnb_gc_fix.warning import logger


class _Covering(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """The fix's wrapper of a library's register function."""


def _register_and_cover(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """The library's register function, then the module it quantized covered."""
    result = wrapped(*args, **kwargs)
    cover.cover(args[0] if args else kwargs.get("module"))  # never raises: what is not a module stays as is
    return result


def put_in(module: ModuleType, pair: tuple[FunctionType, FunctionType], library: Library) -> None:
    """Wrap the module's register function (once), then give its pair of hook functions the fix's code,
    keeping their own signatures (once). Where the wrapping fails, nothing has changed."""
    register = getattr(module, library.register_name)
    if not isinstance(register, _Covering):
        setattr(module, library.register_name, _Covering(register, _register_and_cover))
    for function, code_of in zip(pair, (hooks.pre_hook, hooks.off_hook)):
        if function.__code__ is code_of.__code__:
            continue
        function.__signature__ = inspect.signature(function)  # type: ignore[attr-defined]
        function.__code__ = code_of.__code__
        function.__defaults__ = code_of.__defaults__  # None: every bound name is keyword-only
        function.__kwdefaults__ = code_of.__kwdefaults__
    cover.FIXED_PAIRS[pair] = library.name
    version = version_of(library.name)
    logger.info("bnb-gc-fix put its fix into %s %s (%s)", library.name, version, library.module_name)
