"""Putting the fix into a library's module, and taking it out again.

The module's two hook functions keep their identity, so a pickle names them as before and every module
that holds them, registered before the fix turned on or after, runs the fix: what changes is their code
(``__code__`` and ``__defaults__``, which Python lets a program replace) for the gate's. The register
function is wrapped (wrapt), so that each module it quantizes is taken over at once. Everything changed is
recorded here, so that :func:`remove` puts it back wherever it is now: a module imported again, or one no
longer in ``sys.modules``.
"""

from __future__ import annotations

import inspect
from types import CodeType, FunctionType, ModuleType
from typing import Any, NamedTuple

import torch
import wrapt

from _bnb_gc_fix import DISABLE, ENABLE, Library
from bnb_gc_fix import gate

#: By name, the gate function whose code and defaults each of a library's hook functions gets.
_GATE_FUNCTIONS = {ENABLE: gate.enable_code, DISABLE: gate.disable_code}


class _Own(NamedTuple):
    """What a hook function given the gate's code had of its own, to put back."""

    module_name: str  # the library module it was given the gate's code in (Library.module_name)
    code: CodeType
    defaults: Any


#: Each hook function given the gate's code; one a reload of its module replaced stays until removed.
_own: dict[FunctionType, _Own] = {}
#: By library module name, each module object whose register function the fix wrapped.
_wrapped: dict[str, list[ModuleType]] = {}


class _RegisterWrapper(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """Marks the fix's wrapper of a register function."""


def _take_over_what_it_registered(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    module = args[0] if args else kwargs.get("module")
    if isinstance(module, torch.nn.Module):
        gate.take_over(module)
    return result


def _own_code(function: FunctionType) -> CodeType:
    own = _own.get(function)
    return function.__code__ if own is None else own.code


def unexpected(module: ModuleType, library: Library) -> str | None:
    """What of the module does not look as the fix needs it (None: all does): each hook function a plain
    function taking exactly torch's arguments for its hook, and the register function."""
    for name, gate_function in _GATE_FUNCTIONS.items():
        function = getattr(module, name, None)
        if not isinstance(function, FunctionType):
            return f"{library.module_name}.{name} is not a Python function"
        bound = len(gate_function.__defaults__ or ())  # the names the gate's code binds, after torch's
        expected = gate_function.__code__.co_argcount - bound
        code = _own_code(function)
        starred = code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
        plain = code.co_kwonlyargcount == 0 and not starred
        if function.__closure__ or code.co_argcount != expected or not plain:
            return f"{library.module_name}.{name} does not take the {expected} arguments torch gives a hook"
    if not callable(getattr(module, library.register, None)):
        return f"{library.module_name} has no {library.register}()"
    return None


def apply(module: ModuleType, library: Library) -> None:
    """Give the module's hook functions the gate's code, and wrap its register function (once)."""
    functions = [getattr(module, name) for name in _GATE_FUNCTIONS]
    for function, gate_function in zip(functions, _GATE_FUNCTIONS.values()):
        _own.setdefault(function, _Own(library.module_name, function.__code__, function.__defaults__))
        function.__code__ = gate_function.__code__
        function.__defaults__ = gate_function.__defaults__
    pair = (functions[0], functions[1])
    if pair not in gate.PAIRS:
        gate.PAIRS.append(pair)
    register = getattr(module, library.register)
    if not isinstance(register, _RegisterWrapper):
        setattr(module, library.register, _RegisterWrapper(register, _take_over_what_it_registered))
        _wrapped.setdefault(library.module_name, []).append(module)


def remove(library: Library) -> None:
    """Put the library's own code back into every hook function the fix gave its code (those a reload
    replaced included), and its own register function into every module object the fix wrapped it in
    (one no longer in ``sys.modules`` included)."""
    given = [function for function, own in _own.items() if own.module_name == library.module_name]
    for function in given:
        own = _own.pop(function)
        function.__code__ = own.code
        function.__defaults__ = own.defaults
    gate.PAIRS[:] = [pair for pair in gate.PAIRS if pair[0] not in given]
    for module in _wrapped.pop(library.module_name, []):
        register = getattr(module, library.register, None)
        if isinstance(register, _RegisterWrapper):
            setattr(module, library.register, register.__wrapped__)


def is_applied(module: ModuleType) -> bool:
    """Whether the module's hook functions run the fix's code right now (a reload makes new ones)."""
    for name, gate_function in _GATE_FUNCTIONS.items():
        function = getattr(module, name, None)
        if getattr(function, "__code__", None) is not gate_function.__code__:
            return False
    return True
