"""What a library's hooks do, read from its register function's code at import, without running any of it.

The register function's bytecode says which functions it registers, and how: a module global passed
alone to ``register_forward_pre_hook`` or ``register_forward_hook``, the latter with ``always_call=True``
or not. Each function is then recognised by its code: the same bytecode, constants and names (torch's
parametrize module under whatever name) as a known hook of the pair, compiled here from its source, so a
function's line numbers, annotations and comments do not matter. No function of the library is called.

A register function whose code calls neither registering method registers nothing. A helper it calls is
read the same way, never run: one of the same module that registers, or one of another module whose code
names a registering method. Where the code does not say plainly what it registers (a hook passed to a
helper or held in a closure, a hook wrapped in ``functools.partial``, other arguments, a function of
another shape), the library's hooks cannot be read.
"""

from __future__ import annotations

import dis
import inspect
from dataclasses import dataclass
from types import CodeType, FunctionType, ModuleType
from typing import Any

import torch.nn.utils.parametrize as P

from bnb_gc_fix.libraries import Library
from bnb_gc_fix.verdict import Hooks


@dataclass(frozen=True)
class Reading:
    """What a library module's register function was read to register."""

    hooks: Hooks
    said: str  # what was read, for status(): "..._register_parametrization_hooks() registers ..."
    pair: tuple[FunctionType, FunctionType] | None = None  # (pre-hook, off hook), where it registers them


ADDS = "adds 1"
TAKES = "takes 1 off"
TAKES_CLAMPED = "takes 1 off, never below 0"
#: The hooks the fix knows, as the libraries write them, by what each does.
KNOWN = {
    ADDS: "def hook(module, inputs):\n    P._cache_enabled += 1\n",
    TAKES: (
        "def hook(module, inputs, output):\n"
        "    P._cache_enabled -= 1\n"
        "    if not P._cache_enabled:\n"
        "        P._cache = {}\n"
    ),
    TAKES_CLAMPED: (  # bitsandbytes 0.50's
        "def hook(module, inputs, output):\n"
        "    P._cache_enabled = max(0, P._cache_enabled - 1)\n"
        "    if not P._cache_enabled:\n"
        "        P._cache = {}\n"
    ),
}
PRE_HOOK = "register_forward_pre_hook"
OFF_HOOK = "register_forward_hook"
#: The instructions that end a call's arguments, on Python 3.9 to 3.13.
CALLS = ("CALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW", "CALL_KW")


def _compiled(source: str) -> CodeType:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<bnb-gc-fix: a known hook>", "exec"), namespace)
    code: CodeType = namespace["hook"].__code__
    return code


_KNOWN_CODE = {what: _compiled(source) for what, source in KNOWN.items()}


def register_named(library: Library) -> str:
    """``bitsandbytes.nn.parametrize._register_parametrization_hooks()``."""
    return f"{library.module_name}.{library.register_name}()"


def read(library: Library, module: ModuleType) -> Reading:
    """What the library module's register function registers. Never raises: code it cannot read is read
    as unreadable."""
    named = register_named(library)
    register = getattr(module, library.register_name, None)
    if not isinstance(register, FunctionType):
        said = f"{library.module_name} has no Python function {library.register_name}()"
        return Reading(Hooks.UNREADABLE, said)
    try:
        registered = _registrations(register, frozenset())
    except Exception:  # a code object this reading does not understand
        registered = None
    if registered == {PRE_HOOK: [], OFF_HOOK: []}:
        return Reading(Hooks.DO_NOT_LEAK, f"{named} registers no forward hooks")
    pair = _known_pair(registered)
    if registered is None or pair is None:
        return Reading(Hooks.UNREADABLE, f"the code of {named} does not say plainly what it registers")
    ((_, always_called),) = registered[OFF_HOOK]
    if always_called:
        said = f"{named} registers an off hook that torch calls even when a forward raises"
        return Reading(Hooks.DO_NOT_LEAK, said, pair)
    return Reading(Hooks.LEAK, f"{named} registers an off hook that torch skips when a forward raises", pair)


Registrations = dict[str, list[tuple[Any, bool]]]


def _known_pair(registered: Registrations | None) -> tuple[FunctionType, FunctionType] | None:
    """The known pair registered, each once, the pre-hook never always called (None: anything else)."""
    if registered is None or len(registered[PRE_HOOK]) != 1 or len(registered[OFF_HOOK]) != 1:
        return None
    ((pre_hook, pre_always),), ((off_hook, _),) = registered[PRE_HOOK], registered[OFF_HOOK]
    if pre_always or _does(pre_hook) != ADDS or _does(off_hook) not in (TAKES, TAKES_CLAMPED):
        return None
    return pre_hook, off_hook


def _registrations(function: FunctionType, seen: frozenset[CodeType]) -> Registrations | None:
    """The (function, always called) that ``function`` passes to each of torch's two registering methods,
    itself or through a helper whose code names them; None where it passes anything else, names a
    registering method another way (a string, a nested function), or calls what a closure holds."""
    code, namespace = function.__code__, function.__globals__
    found: Registrations = {PRE_HOOK: [], OFF_HOOK: []}
    if function.__closure__ is not None or _names_elsewhere(code):
        return None
    instructions = list(dis.get_instructions(code))
    for index, instruction in enumerate(instructions):
        helper = _helper(instruction, namespace, seen | {code})
        if helper is not None:
            inner = _registrations(helper, seen | {code})
            if inner is None:
                return None
            found[PRE_HOOK] += inner[PRE_HOOK]
            found[OFF_HOOK] += inner[OFF_HOOK]
        if instruction.argval not in found or instruction.opname not in ("LOAD_METHOD", "LOAD_ATTR"):
            continue
        registration = _registration(instructions[index + 1 :], namespace, code.co_consts)
        if registration is None:
            return None
        found[instruction.argval].append(registration)
    return found


def _helper(
    instruction: dis.Instruction, namespace: dict[str, Any], seen: frozenset[CodeType]
) -> FunctionType | None:
    """The function that ``instruction`` loads where its code registers: one of the same module that does
    (itself or through such a helper), or one of another module whose code names a registering method
    (a tool's function in the library's place that calls the library's). None for anything else."""
    if instruction.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
        return None
    function = namespace.get(instruction.argval)
    if not isinstance(function, FunctionType) or function.__code__ in seen:
        return None
    if function.__globals__ is namespace and _registers(function.__code__, namespace, seen):
        return function
    if _names_a_registering_method(function.__code__):
        return function
    return None


def _names_a_registering_method(code: CodeType) -> bool:
    return PRE_HOOK in code.co_names or OFF_HOOK in code.co_names


def _registers(code: CodeType, namespace: dict[str, Any], seen: frozenset[CodeType]) -> bool:
    """Whether ``code`` names a registering method, itself or through functions of the same module."""
    if _names_a_registering_method(code):
        return True
    helpers = [namespace.get(name) for name in code.co_names]
    own = [f.__code__ for f in helpers if isinstance(f, FunctionType) and f.__globals__ is namespace]
    return any(_registers(each, namespace, seen | {code}) for each in own if each not in seen | {code})


def _names_elsewhere(code: CodeType) -> bool:
    """Whether a string constant of ``code`` is a registering method's name, or a function defined inside
    it names one (a registration this reading cannot follow)."""
    constants = code.co_consts
    nested = [each for each in constants if isinstance(each, CodeType)]
    named = any(map(_names_a_registering_method, nested))
    return named or PRE_HOOK in constants or OFF_HOOK in constants or any(map(_names_elsewhere, nested))


def _registration(
    after: list[dis.Instruction], namespace: dict[str, Any], consts: tuple[Any, ...]
) -> tuple[Any, bool] | None:
    """The function passed alone to a registering method whose name was just loaded, and whether with
    ``always_call=True``; None for anything else."""
    if not after or after[0].opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
        return None
    function = namespace.get(after[0].argval)
    if not isinstance(function, FunctionType) or function.__closure__ is not None:
        return None
    rest = _until_the_call(after[1:], consts)
    if not rest:
        return function, False
    if rest in ALWAYS_CALL:
        return function, True
    return None


#: What follows the function up to the call where it is registered with ``always_call=True`` alone.
ALWAYS_CALL = (
    [("LOAD_CONST", True), ("LOAD_CONST", ("always_call",))],  # Python 3.9, 3.10, 3.13
    [("LOAD_CONST", True), ("KW_NAMES", ("always_call",))],  # Python 3.11, 3.12
)


def _until_the_call(instructions: list[dis.Instruction], consts: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """Each instruction up to the next call, as (name, value), but those that do nothing."""
    found = []
    for instruction in instructions:
        if instruction.opname in CALLS:
            break
        if instruction.opname == "KW_NAMES":  # its value is a constant (3.11's dis does not resolve it)
            found.append((instruction.opname, consts[instruction.arg or 0]))
        elif instruction.opname not in ("PRECALL", "NOP", "CACHE"):
            found.append((instruction.opname, instruction.argval))
    return found


def _does(function: FunctionType) -> str | None:
    """Which known hook ``function``'s code is (torch's parametrize module under any global name)."""
    code = function.__code__
    names = tuple(_as_known(name, function.__globals__) for name in code.co_names)
    for what, known in _KNOWN_CODE.items():
        if names == known.co_names and _same_code(code, known):
            return what
    return None


def _as_known(name: str, namespace: dict[str, Any]) -> str:
    """``name`` as the known hooks spell it: ``P`` where it is torch's parametrize module; a name the known
    hooks never use where ``P`` is something else."""
    if namespace.get(name) is P:
        return "P"
    return "<not torch's parametrize>" if name == "P" else name


def _same_code(code: CodeType, known: CodeType) -> bool:
    """The same bytecode, constants, arguments and kind of function (an ``async def`` is not a hook)."""
    return (
        code.co_code == known.co_code
        and code.co_consts == known.co_consts
        and code.co_argcount == known.co_argcount
        and code.co_kwonlyargcount == known.co_kwonlyargcount
        and code.co_posonlyargcount == known.co_posonlyargcount
        and code.co_flags & _KIND == known.co_flags & _KIND
    )


#: The flags that say what kind of function a code object is (``__future__`` imports set others).
_KIND = (
    inspect.CO_VARARGS
    | inspect.CO_VARKEYWORDS
    | inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ITERABLE_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
)
