"""What a library's hooks do, read from what a module the library quantized holds, never from its version or
the names of its hooks: where its register function's code does not say it plainly
(``bnb_gc_fix.code_reading``), the fix wraps the register function, and the first module the library
itself quantizes through it is read (``bnb_gc_fix.patch``): what the call registered there, a pre-hook and
an off hook, and whether torch always calls the off hook. The pair found is then run against a stand-in
of torch's parametrize module, a copy of each function whose globals hold only the stand-in and a few
pure builtins, given as its module an object that holds nothing, to see whether it is the pair the fix
can take the place of: the pre-hook adds 1 to the counter, the off hook takes 1 off and empties the cache
at 0. Nothing of the process's own state is read or written by the run.
"""

from __future__ import annotations

import builtins
import functools
from dataclasses import dataclass
from enum import Enum
from types import FunctionType
from typing import Any

import torch.nn.utils.parametrize as P

from bnb_gc_fix import census, hooks
from bnb_gc_fix.libraries import Library


class Kind(Enum):
    """What the library's register function was found to register."""

    LEAKS = "a pre-hook and an off hook that torch skips when a forward raises"
    ALWAYS_OFF = "a pre-hook and an off hook that torch always calls (upstream's fix)"
    NOTHING = "no forward hooks, or hooks that never switch the cache"
    UNREADABLE = "no register function, one not read yet, or hooks it cannot read"


#: The builtins a hook of the pair may use on the stand-in (bitsandbytes 0.50's clamp uses ``max``).
_PURE_BUILTINS = {name: getattr(builtins, name) for name in ("max", "min", "abs", "int", "bool")}


@dataclass(frozen=True)
class Reading:
    """What a library module's register function registers."""

    kind: Kind
    said: str  # what was found, for status(): "... registers a pair whose off hook ..."
    pair: tuple[Any, Any] | None = None  # (pre-hook, off hook), where one was registered
    replaceable: bool = False  # plain functions doing what the fix's hooks do in their place (or the fix's)

    @property
    def leaks(self) -> bool | None:
        """Whether the hooks read leak this way (None: they could not be read)."""
        return None if self.kind == Kind.UNREADABLE else self.kind == Kind.LEAKS

    @property
    def always_off(self) -> bool:
        """Whether torch calls the off hook read even when a forward raises (upstream's fix)."""
        return self.kind == Kind.ALWAYS_OFF


@dataclass(frozen=True)
class Hooks:
    """The keys of a module's forward hooks at one moment, to tell what a call registered, and whether an
    off hook of the library's module was among them (the module was quantized with it before)."""

    pre_hooks: frozenset[int]
    off_hooks: frozenset[int]
    the_librarys: bool

    @classmethod
    def of(cls, module: Any, module_name: str) -> Hooks:
        off_hooks = module._forward_hooks
        the_librarys = any(census.defined_in(hook) == module_name for hook in off_hooks.values())
        return cls(frozenset(module._forward_pre_hooks), frozenset(off_hooks), the_librarys)


def read(library: Library, module: Any, before: Hooks) -> Reading | None:
    """What the library's register function registered on ``module`` (one the library quantized), whose
    hooks were ``before`` until it did; None where it registered nothing on a module it had quantized
    before, so that the next module tells."""
    what = registered(module, before, register_named(library))
    if what.kind == Kind.NOTHING and before.the_librarys:
        return None
    return what


def registered(module: Any, before: Hooks, named: str) -> Reading:
    """What ``named`` registered on ``module``, whose hooks were ``before`` until it did."""
    pre_keys = [key for key in module._forward_pre_hooks if key not in before.pre_hooks]
    off_keys = [key for key in module._forward_hooks if key not in before.off_hooks]
    if not pre_keys and not off_keys:
        return Reading(Kind.NOTHING, f"{named} registers no forward hooks")
    with_kwargs = set(module._forward_pre_hooks_with_kwargs) | set(module._forward_hooks_with_kwargs)
    if len(pre_keys) != 1 or len(off_keys) != 1 or with_kwargs & {*pre_keys, *off_keys}:
        said = f"{named} registers {len(pre_keys)} pre-hooks and {len(off_keys)} forward hooks, not one pair"
        return Reading(Kind.UNREADABLE, said)
    pair = (module._forward_pre_hooks[pre_keys[0]], module._forward_hooks[off_keys[0]])
    return _read_pair(pair, off_keys[0] in module._forward_hooks_always_called, named)


def register_named(library: Library) -> str:
    """``bitsandbytes.nn.parametrize._register_parametrization_hooks()``."""
    return f"{library.module_name}.{library.register_name}()"


def without_a_register_function(library: Library) -> Reading:
    """The reading of a library module that has no register function of that name."""
    return Reading(Kind.UNREADABLE, f"{library.module_name} has no {library.register_name}()")


def switching_pair(pair: tuple[Any, Any], always_called: bool, named: str, replaceable: bool) -> Reading:
    """The reading of a pair that switches the cache on and off: upstream's fix where torch always calls
    its off hook, else the leaking pair."""
    if always_called:
        said = f"{named} registers an off hook that torch calls even when a forward raises"
        return Reading(Kind.ALWAYS_OFF, said, pair, replaceable)
    said = f"{named} registers an off hook that torch skips when a forward raises"
    return Reading(Kind.LEAKS, said, pair, replaceable)


def _read_pair(pair: tuple[Any, Any], always_called: bool, named: str) -> Reading:
    """What a registered pair does, ``always_called`` where torch calls its off hook whatever happens."""
    if _is_the_fixs(pair):
        return Reading(Kind.LEAKS, f"{named} registers the pair that the fix is in already", pair, True)
    effect = _effect_on_a_stand_in(pair)
    replaceable = effect == SWITCHES and all(_plain_function(hook) for hook in pair)
    if always_called or effect == SWITCHES:
        return switching_pair(pair, always_called, named, replaceable)
    if effect == NEVER_SWITCHES:
        return Reading(Kind.NOTHING, f"{named} registers forward hooks that never switch the cache", pair)
    said = f"{named} registers forward hooks that bnb-gc-fix cannot read ({effect})"
    return Reading(Kind.UNREADABLE, said, pair)


def _is_the_fixs(pair: tuple[Any, Any]) -> bool:
    codes = (hooks.pre_hook_code.__code__, hooks.off_hook_code.__code__)
    return all(getattr(function, "__code__", None) is code for function, code in zip(pair, codes))


def _plain_function(hook: Any) -> bool:
    """Whether the fix can give ``hook`` its code: a Python function with no closure."""
    return isinstance(hook, FunctionType) and hook.__closure__ is None


# What a pair does to a stand-in of torch's cache.
SWITCHES = "switches it on and off"  # the pre-hook adds 1, the off hook takes 1 off and empties it at 0
NEVER_SWITCHES = "never switches it"  # neither touches the counter nor the cache


class _StandIn:
    """torch's parametrize module as the pair sees it: a counter and a cache."""

    def __init__(self, counter: int) -> None:
        self._cache_enabled = counter
        self._cache: dict[Any, Any] = {"a weight": None}


def _unwrapped(hook: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The function a hook calls, with the arguments functools.partial objects bind to it."""
    function: Any = hook
    bound: tuple[Any, ...] = ()
    keywords: dict[str, Any] = {}
    while isinstance(function, functools.partial):
        function, bound, keywords = function.func, (*function.args, *bound), {**function.keywords, **keywords}
    return function, bound, keywords


def _on_a_stand_in(hook: Any, counter: int, *arguments: Any) -> _StandIn:
    """Run a copy of ``hook``'s Python function whose globals are a stand-in wherever it has torch's
    parametrize module (and nothing else but pure builtins), on a counter at ``counter``; returns the
    stand-in after. Raises where the function reaches for anything else."""
    function, bound, keywords = _unwrapped(hook)
    stand_in = _StandIn(counter)
    names: dict[str, Any] = {name: stand_in for name, value in function.__globals__.items() if value is P}
    names["__builtins__"] = _PURE_BUILTINS
    code, defaults, closure = function.__code__, function.__defaults__, function.__closure__
    copy = FunctionType(code, names, function.__name__, defaults, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy(*bound, *arguments, **keywords)
    return stand_in


class _NoModule:
    """What the copies get as their module: an object that holds nothing and takes nothing, so that a hook
    that uses its module fails to be read (the fix's code would not do what it does)."""

    __slots__ = ()


def _effect_on_a_stand_in(pair: tuple[Any, Any]) -> str:
    """SWITCHES where the pre-hook adds 1 to the counter, leaving the cache, and the off hook takes 1 off,
    emptying the cache only at 0 (what the fix's hooks do in their place); NEVER_SWITCHES where neither
    touches them; else why not, in words."""
    module = _NoModule()
    if not all(isinstance(_unwrapped(hook)[0], FunctionType) for hook in pair):
        return "they are not Python functions"
    pre_hook, off_hook = pair
    try:
        adds = [_on_a_stand_in(pre_hook, counter, module, ()) for counter in (0, 1)]
        takes = [_on_a_stand_in(off_hook, counter, module, (), None) for counter in (2, 1)]
    except Exception as error:  # a global it needs that the stand-in lacks, say
        return f"they reach for more than torch's parametrize module: {type(error).__name__}"
    counters = [after._cache_enabled for after in adds + takes]
    kept = [bool(after._cache) for after in adds + takes]
    if counters == [1, 2, 1, 0] and kept == [True, True, True, False]:
        return SWITCHES
    if counters == [0, 1, 2, 1] and all(kept):
        return NEVER_SWITCHES
    return "they do something else to the cache"
