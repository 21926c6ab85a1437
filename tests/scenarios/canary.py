"""What bnb-gc-fix relies on inside torch and bitsandbytes, observed on the installed releases.

    BNB_GC_FIX=0 python tests/scenarios/canary.py   # one JSON line: {"torch": {...}, "dynamo": {...}, ...}

Run with the fix switched off, so that bitsandbytes' own functions are what is looked at. Each fact is
what the installed code does, measured, never what a version number promises; a fact that cannot be
measured is reported as the error that stopped it ("error: ..."), so one change never hides another.
tests/test_canary.py says what each fact must be and why the package needs it.
"""

from __future__ import annotations

import collections
import inspect
import json
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils.parametrize as P
from torch import nn

FACTS: dict[str, dict[str, Any]] = {"torch": {}, "parametrize": {}, "dynamo": {}, "bitsandbytes": {}}


def fact(group: str, name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def record(measure: Callable[[], Any]) -> Callable[[], Any]:
        try:
            FACTS[group][name] = measure()
        except Exception as error:
            last = traceback.extract_tb(error.__traceback__)[-1]
            FACTS[group][name] = f"error: {type(error).__name__}: {error} ({last.name}:{last.lineno})"
        return measure

    return record


# --- torch.nn.Module: the hook dictionaries ----------------------------------------------------------


HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@fact("torch", "hook_dictionaries")
def _hook_dictionaries() -> Any:
    """Each registration's handle id is its key in the module's hook dictionaries (ordered dicts)."""
    module = nn.Linear(2, 2)
    pre = module.register_forward_pre_hook(lambda m, a: None)
    pre_kw = module.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    post = module.register_forward_hook(lambda m, a, o: None)
    post_kw = module.register_forward_hook(lambda m, a, k, o: None, with_kwargs=True)
    always = module.register_forward_hook(lambda m, a, o: None, always_call=True)
    dicts = {name: getattr(module, name, None) for name in HOOK_DICTS}
    return {
        "ordered_dicts": {name: isinstance(d, collections.OrderedDict) for name, d in dicts.items()},
        "pre_hook_keys": list(dicts["_forward_pre_hooks"]) == [pre.id, pre_kw.id],
        "pre_with_kwargs": list(dicts["_forward_pre_hooks_with_kwargs"]) == [pre_kw.id],
        "hook_keys": list(dicts["_forward_hooks"]) == [post.id, post_kw.id, always.id],
        "hook_with_kwargs": list(dicts["_forward_hooks_with_kwargs"]) == [post_kw.id],
        "always_called": list(dicts["_forward_hooks_always_called"]) == [always.id],
    }


@fact("torch", "hooks_run_from_the_dictionaries")
def _hooks_run() -> Any:
    """torch runs what the dictionaries hold, in their order, when the call happens: a hook assigned to
    an existing key runs in that key's place, a deleted key's hook is gone, and a key put into the
    always-called dictionary by hand makes its hook run when the forward raises."""
    order: list[str] = []
    module = nn.Linear(2, 2)
    keys = [
        module.register_forward_pre_hook(lambda m, a, n=n: order.append(f"pre-{n}")).id
        for n in ("a", "b", "c")
    ]
    post = [
        module.register_forward_hook(lambda m, a, o, n=n: order.append(f"post-{n}")).id for n in ("a", "b")
    ]
    module._forward_pre_hooks[keys[1]] = lambda m, a: order.append("pre-replaced")
    del module._forward_pre_hooks[keys[2]]
    del module._forward_hooks[post[0]]
    module._forward_hooks_always_called[post[1]] = True
    module(torch.zeros(2))

    def raising(m: nn.Module, args: Any) -> None:
        raise RuntimeError("a pre-hook registered after the others raises")

    module.register_forward_pre_hook(raising)
    try:
        module(torch.zeros(2))
    except RuntimeError:
        order.append("raised")
    return order


@fact("torch", "hooks_when_the_forward_raises")
def _hooks_when_raising() -> Any:
    """Which forward hooks run when the forward raises: always-called ones for an Exception; for a
    BaseException (KeyboardInterrupt) none (the fix switches that off at the module's next forward)."""
    out: dict[str, list[str]] = {}
    for raised in (RuntimeError, KeyboardInterrupt):
        ran: list[str] = []

        class Raising(nn.Module):
            def forward(self, x: Any, raised: type[BaseException] = raised) -> Any:
                raise raised("from the forward")

        module = Raising()
        module.register_forward_hook(lambda m, a, o, ran=ran: ran.append("plain"))
        module.register_forward_hook(lambda m, a, o, ran=ran: ran.append("always_call"), always_call=True)
        try:
            module(torch.zeros(1))
        except BaseException:
            pass
        out[raised.__name__] = ran
    return out


# --- torch.nn.utils.parametrize: the global cache --------------------------------------------------


class Double(nn.Module):
    def forward(self, x: Any) -> Any:
        return x * 2


def parametrized() -> nn.Module:
    module = nn.Linear(3, 3)
    P.register_parametrization(module, "weight", Double())
    return module


@fact("parametrize", "globals")
def _globals() -> Any:
    return {
        "counter": [type(P._cache_enabled).__name__, P._cache_enabled],
        "cache": [type(P._cache).__name__, len(P._cache)],
    }


@fact("parametrize", "cached_block")
def _cached_block() -> Any:
    """``P.cached()`` counts up and down the module-level counter and empties (rebinds) the cache at zero."""
    module = parametrized()
    with P.cached():
        inside = P._cache_enabled
        _ = module.weight
        cache = P._cache
        entries = len(cache)
        same = module.weight is module.weight
    return {
        "inside": inside,
        "entries": entries,
        "same_tensor": same,
        "after": P._cache_enabled,
        "emptied": len(P._cache) == 0,
    }


@fact("parametrize", "cache_follows_the_counter")
def _follows_counter() -> Any:
    """A parametrized attribute is cached whenever the counter is above zero, in whatever dict the module
    global ``_cache`` is at that moment (the fix and bitsandbytes set both by hand)."""
    module = parametrized()
    P._cache_enabled += 1
    P._cache = {}
    mine = P._cache
    _ = module.weight
    stored = len(mine)
    P._cache_enabled -= 1
    P._cache = {}
    _ = module.weight
    return {"stored_while_on": stored, "stored_while_off": len(P._cache)}


# --- Dynamo: its compiler switches ---------------------------------------------------------------------


@fact("dynamo", "switches")
def _switches() -> Any:
    compiling = torch.compiler.is_dynamo_compiling

    def traced(x: Any) -> Any:
        return x + (1 if compiling() else 0)

    compiled = torch.compile(traced, backend="eager", fullgraph=True)
    return {
        "folded_true_when_traced": float(compiled(torch.zeros(1))[0]) == 1.0,
        "false_in_eager": float(traced(torch.zeros(1))[0]) == 0.0,
    }


# --- bitsandbytes: the function the fix reads, and what it registers ------------------------------------


def _bitsandbytes() -> None:
    import bitsandbytes
    from bitsandbytes.nn import parametrize as bnb

    from bnb_gc_fix import libraries

    target = libraries.BITSANDBYTES  # the package's statement of the library
    group = FACTS["bitsandbytes"]
    group["version"] = getattr(bitsandbytes, "__version__", None)
    group["target_module"] = target.module_name == bnb.__name__

    @fact("bitsandbytes", "functions")
    def _functions() -> Any:
        """The register function the fix reads (by its name) and the quantizer, callable with a module and a
        parameter's name first."""
        out: dict[str, Any] = {}
        for name in (target.register_name, target.quantizer_name):
            function = getattr(bnb, name, None)
            positional = [
                p
                for p in inspect.signature(function).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            out[name] = callable(function) and len(positional) >= 2
        return out

    def _pre_hook() -> Any:
        """The pre-hook function the register function registers."""
        module = nn.Module()
        getattr(bnb, target.register_name)(module, "weight")
        return next(iter(module._forward_pre_hooks.values()))

    @fact("bitsandbytes", "code_replaced_in_place")
    def _code_replaced() -> Any:
        """A hook function given other code (``__code__``, ``__kwdefaults__``) keeps its identity, and a
        module holding it runs the new code (Python's data model; checked on this interpreter)."""
        enable = _pre_hook()
        own = (enable.__code__, enable.__kwdefaults__)
        calls: list[str] = []

        def other(module: Any, inputs: Any, *, record: Any = calls.append) -> None:
            record("other")

        module = nn.Linear(2, 2)
        module.register_forward_pre_hook(enable)
        try:
            enable.__code__, enable.__kwdefaults__ = other.__code__, other.__kwdefaults__
            module(torch.zeros(2))
        finally:
            enable.__code__, enable.__kwdefaults__ = own
        return {"ran": calls, "same_object": _pre_hook() is enable, "counter": P._cache_enabled}

    @fact("bitsandbytes", "registered_pair")
    def _registered_pair() -> Any:
        """What ``replace_parameter_4bit`` and ``_register_parametrization_hooks`` leave on a module: one
        pre-hook and one forward hook per parameter, from bitsandbytes.nn.parametrize; always-called from
        the first fixed release on."""
        out = {}
        for how in (target.quantizer_name, target.register_name):
            module = nn.Linear(64, 64)
            if how == "replace_parameter_4bit":
                bnb.replace_parameter_4bit(module, "weight")
            else:
                getattr(bnb, how)(module, "weight")
            pre = list(module._forward_pre_hooks.values())
            post = list(module._forward_hooks.values())
            out[how] = {
                "pre_hooks": len(pre),
                "forward_hooks": len(post),
                "from": sorted({getattr(h, "__module__", "?") for h in pre + post}),
                "always_called": sorted(module._forward_hooks_always_called) == sorted(module._forward_hooks),
            }
        return out

    @fact("bitsandbytes", "enable_and_disable")
    def _enable_and_disable() -> Any:
        """The pair's functions move torch's counter by one and empty the cache at zero."""
        module = nn.Linear(2, 2)
        getattr(bnb, target.register_name)(module, "weight")
        enable = module._forward_pre_hooks[min(module._forward_pre_hooks)]
        disable = module._forward_hooks[min(module._forward_hooks)]
        start = P._cache_enabled
        enable(module, ())
        on = P._cache_enabled - start
        P._cache["canary"] = torch.ones(1)
        disable(module, (), None)
        return {"enable_adds": on, "disable_back_to": P._cache_enabled - start, "emptied": len(P._cache) == 0}

    @fact("bitsandbytes", "read")
    def _read() -> Any:
        """What the package reads of the installed release's register function's code: a pair that leaks
        (or, from the first fixed release on, one whose off hook is always called), which the fix can take
        the place of."""
        from bnb_gc_fix import reading

        found = reading.read(target, bnb)
        return {"hooks": found.hooks.value, "pair": found.pair is not None}

    @fact("bitsandbytes", "forward_caches_the_dequantized_weight")
    def _forward_caches() -> Any:
        """Inside a 4-bit module's forward the cache is on and holds its dequantized weight; after it,
        off and empty (this is the cache that leaks when the switch-off is skipped)."""
        module = nn.Linear(64, 64)
        bnb.replace_parameter_4bit(module, "weight")
        inside: dict[str, Any] = {}

        def before(m: nn.Module, args: Any) -> None:  # registered after bitsandbytes' enable hook
            inside["counter"] = P._cache_enabled

        def after(m: nn.Module, args: Any, out: Any) -> None:  # prepended: before its disable hook
            inside["entries"] = len(P._cache)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after, prepend=True)
        with torch.no_grad():
            module(torch.randn(1, 64))
        return {"during": inside, "after": [P._cache_enabled, len(P._cache)]}


try:
    _bitsandbytes()
except Exception as error:
    FACTS["bitsandbytes"]["import"] = f"error: {type(error).__name__}: {error}"

print(json.dumps(FACTS))
