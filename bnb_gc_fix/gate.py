"""The cache gate: one pair of hooks per module in the place of bitsandbytes' plain pairs.

bitsandbytes 0.48-0.49 switch torch's parametrization cache on and off around every forward of a
quantized module with a plain pair of hooks per parameter; a forward left by an exception skips the
"off", so the cache is never emptied again. A gate counts, per thread, the holds its pre-hook took and
its always-called forward hook has not given back (:class:`_Holds`), and moves torch's counter by as
much. A hold a ``BaseException`` left is found at the module's next forward on that thread (:func:`_walk`);
holds are given back when their module is collected, their thread ends, or a forked child drops it. The
counter's update has no call in it (the GIL never interrupts it, 3.10+) and a lock on free-threaded builds.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar, cast

import torch
import torch.nn.utils.parametrize as P

import _bnb_gc_fix_cache as cache

ENABLE_NAME, DISABLE_NAME = "_enable_parametrization_cache", "_disable_parametrization_cache"
ORIGIN = "bitsandbytes.nn.parametrize"

_CALL_IMPL = torch.nn.Module._call_impl.__code__
# torch.compile runs `_call_impl` as Dynamo's copy of its code (same name and file) or a resume function.
_RESUME_PREFIX = "torch_dynamo_resume_in__call_impl"
_GIL = cache.gil_enabled()
_LOCK = threading.RLock()  # taken by the gate of a free-threaded build
_frame = sys._getframe
_F = TypeVar("_F", bound=Callable[..., Any])
# True where Dynamo traces the caller (it folds the call to a constant), False elsewhere.
_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", None) or (
    lambda: bool(torch._dynamo.is_compiling())  # torch < 2.3
)


def _eager_only(function: _F) -> _F:
    """Keep ``function`` out of torch.compile's traces: Dynamo calls it as it is, in a graph break."""
    try:
        return cast(_F, torch.compiler.disable(function))  # type: ignore[no-untyped-call]
    except Exception:  # a torch without a usable compiler: nothing traces it there
        return function


class _Holds:
    """One thread's holds on one gate, given back when it dies (thread ended, module collected)."""

    __slots__ = ("__weakref__", "anchor", "anchor_depth", "anchor_n", "gate", "n", "thread")

    def __init__(self, gate: weakref.ref[Gate]) -> None:
        self.n = 0
        self.gate = gate
        self.thread = threading.get_ident()
        # The innermost live call holding the first `anchor_n` holds, and its depth below the pre-hook
        # at the last walk: while it is on the stack, so are they (see _walk).
        self.anchor: FrameType | None = None
        self.anchor_n = 0
        self.anchor_depth = 0

    def __del__(self) -> None:
        try:
            held, self.n = self.n, 0
            if held:
                cache.give_back(held)
        except Exception:  # at interpreter shutdown
            pass


_HOLDS: weakref.WeakSet[_Holds] = weakref.WeakSet()  # every thread's holds on every gate


def _every_holds() -> list[_Holds]:
    """A snapshot of :data:`_HOLDS`, which another thread's first forward of a gate may add to."""
    while True:
        with contextlib.suppress(RuntimeError):  # "Set changed size during iteration": take it again
            return list(_HOLDS)


class _PerThread(threading.local):
    def __init__(self, gate: weakref.ref[Gate]) -> None:  # runs once in every thread that uses it
        self.holds = _Holds(gate)
        _HOLDS.add(self.holds)


class Gate:
    """The parametrization-cache gate of one module. Its two bound methods are the hooks."""

    __slots__ = ("__weakref__", "origin", "threads")

    def __init__(self, origin: str = ORIGIN) -> None:
        self.origin = origin  # the module whose plain pair this gate replaced: what its hooks pickle as
        self.threads = _PerThread(weakref.ref(self))

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        # A pickled hook `gate.<name>` loads as `getattr(origin module, <name>)`: the plain function.
        return (importlib.import_module, (self.origin,))

    def __deepcopy__(self, memo: dict[int, Any]) -> Gate:
        return type(self)(self.origin)  # a copied module gets a fresh gate: holds belong to live calls

    def _enable_parametrization_cache(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: take one hold on this thread and switch the cache on."""
        holds = self.threads.holds
        held = holds.n
        if held:  # a self-call, or a hold left by a BaseException: heal (see _walk)
            if _compiling():
                _walk(module, holds, None)  # outside the trace: a graph break
            else:
                try:  # the same holds, and their innermost call still on the stack: all live
                    live = holds.anchor_n == held and _frame(holds.anchor_depth) is holds.anchor
                except ValueError:  # the stack is not that deep any more
                    live = False
                if not live:
                    _walk(module, holds, _frame())
            held = holds.n
        holds.n = held + 1
        P._cache_enabled += 1

    def _disable_parametrization_cache(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Always-called forward hook: give back one hold, if the pre-hook took one on this thread."""
        holds = self.threads.holds
        held = holds.n
        # cache.give_back(1) inlined: a call costs time and lets a thread switch or a Ctrl-C in between.
        if held:
            holds.n = held - 1
            if held <= holds.anchor_n:  # the anchored call has ended: let its frame go
                holds.anchor, holds.anchor_n = None, 0
            remaining = P._cache_enabled - 1
            if remaining > 0:
                P._cache_enabled = remaining
            else:
                P._cache_enabled = 0
                P._cache = {}


class _LockedGate(Gate):
    """The gate for free-threaded Python builds, where the counter's update needs a lock."""

    __slots__ = ()

    def _enable_parametrization_cache(self, module: torch.nn.Module, args: Any) -> None:
        with _LOCK:
            super()._enable_parametrization_cache(module, args)

    def _disable_parametrization_cache(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with _LOCK:
            super()._disable_parametrization_cache(module, args, output)


def _after_fork_in_child() -> None:
    """A forked child has one thread: give back every other thread's holds (also one a frame keeps)."""
    global _LOCK
    _LOCK = threading.RLock()  # never wait on a lock one of the parent's threads held
    with contextlib.suppress(Exception):  # never disturb a fork
        me = threading.get_ident()
        for holds in _every_holds():
            if holds.thread != me:
                held, holds.n = holds.n, 0
                holds.anchor, holds.anchor_n = None, 0
                if held:
                    cache.give_back(held)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_GATE: type[Gate] = Gate if _GIL else _LockedGate


def _calls_on_this_thread(frame: FrameType | None) -> Iterator[tuple[int, FrameType]]:
    """Every ``Module._call_impl`` frame (eager or compiled) from ``frame`` down, with its depth below it."""
    depth = 0
    while frame is not None:
        code = frame.f_code
        if code is _CALL_IMPL or (
            code.co_filename == _CALL_IMPL.co_filename
            and (code.co_name == _CALL_IMPL.co_name or code.co_name.startswith(_RESUME_PREFIX))
        ):
            yield depth, frame
        frame = frame.f_back
        depth += 1


@_eager_only
def _walk(module: torch.nn.Module, holds: _Holds, start: FrameType | None) -> None:
    """Give back this thread's holds on ``module`` that no live call of it on this thread owns: called
    by the pre-hook (frame ``start``) on a self-call (live) or after a BaseException (stale). The stack
    is read down only until every hold is accounted for, and the innermost holding call kept with its
    depth (the anchor), so a module that calls itself again and again is walked once, not per call."""
    held = holds.n
    holds.anchor, holds.anchor_n = None, 0
    if start is None:  # called where torch.compile traces the pre-hook: depths count from its caller
        start = _frame(1)
    live = -1  # the innermost call found is the one being entered, which holds nothing yet
    for depth, frame in _calls_on_this_thread(start):
        if frame.f_locals.get("self") is module:
            live += 1
            if live == 1:
                holds.anchor, holds.anchor_depth = frame, depth
            if live >= held:
                holds.anchor_n = held
                return
    holds.n = holds.anchor_n = live = max(live, 0)  # the anchor, if found, is the innermost of these
    cache.give_back(held - live)


def _is_gate_hook(hook: object) -> bool:
    return isinstance(getattr(hook, "__self__", None), Gate)


def gate_of(module: torch.nn.Module) -> Gate | None:
    owners = (getattr(hook, "__self__", None) for hook in module._forward_pre_hooks.values())
    return next((owner for owner in owners if isinstance(owner, Gate)), None)


def _named(hook: object, name: str) -> bool:
    # bitsandbytes' functions, wrapt wrappers of them, and look-alikes (axolotl's moe_quant).
    return getattr(hook, "__name__", None) == name and not _is_gate_hook(hook)


def cache_hooks(module: torch.nn.Module) -> tuple[list[int], list[int], bool]:
    """The keys of the module's enable pre-hooks and disable forward hooks that are not ours (matched
    by function name, in order), and whether there are disable hooks and all are always-called."""
    enables = [key for key, hook in module._forward_pre_hooks.items() if _named(hook, ENABLE_NAME)]
    disables = [key for key, hook in module._forward_hooks.items() if _named(hook, DISABLE_NAME)]
    always_called = bool(disables) and all(key in module._forward_hooks_always_called for key in disables)
    return enables, disables, always_called


class _AlwaysCalled(collections.OrderedDict):  # type: ignore[type-arg]
    """``_forward_hooks_always_called``, pickled without the gate's entry where the old pair was plain."""

    __slots__ = ("plain",)

    def __init__(self, items: Any = (), plain: frozenset[int] = frozenset()) -> None:
        super().__init__(items)
        self.plain = plain

    def __reduce__(self) -> tuple[Any, ...]:
        return (collections.OrderedDict, ([(k, v) for k, v in self.items() if k not in self.plain],))

    def __deepcopy__(self, memo: dict[int, Any]) -> _AlwaysCalled:
        return _AlwaysCalled(self.items(), self.plain)


def _take_place(hooks: dict[int, Any], keys: list[int], hook: object, first: bool) -> int:
    """Put ``hook`` where the first (or last) of ``keys`` is in ``hooks`` and drop the others."""
    order = [key for key in hooks if key in keys]
    keep = order[0] if first else order[-1]
    for key in order:
        if key != keep:
            del hooks[key]
    hooks[keep] = hook  # assigning to an existing key keeps its place
    return keep


def install(module: torch.nn.Module, replace_always_called: bool = False) -> bool:
    """Replace every plain cache pair (bitsandbytes' or a copy's) on ``module`` with its one gate, in the
    pair's places; returns whether the module changed. A module without an enable hook is left alone, and
    so is one whose pairs are right (disables always-called: bitsandbytes 0.50) unless
    ``replace_always_called``."""
    enables, disables, always_called = cache_hooks(module)
    if not enables or (always_called and len(disables) == len(enables) and not replace_always_called):
        return False
    pre_hooks, post_hooks = module._forward_pre_hooks, module._forward_hooks
    gate = gate_of(module) or _GATE(getattr(pre_hooks[enables[0]], "__module__", None) or ORIGIN)
    enter, leave = gate._enable_parametrization_cache, gate._disable_parametrization_cache
    ours = [key for key, hook in pre_hooks.items() if _is_gate_hook(hook)]
    kept = _take_place(pre_hooks, ours + enables, enter, first=True)
    for key in enables + ours:
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    always = module._forward_hooks_always_called
    if not isinstance(always, _AlwaysCalled):
        always = module._forward_hooks_always_called = _AlwaysCalled(always.items())
    plain = {key for key in disables if key not in always} | always.plain
    ours = [key for key, hook in post_hooks.items() if _is_gate_hook(hook)]
    if disables or ours:
        kept = _take_place(post_hooks, ours + disables, leave, first=False)
    else:  # an enable hook alone: the gate still needs its forward hook
        kept = module.register_forward_hook(leave).id
    for key in disables + ours:
        module._forward_hooks_with_kwargs.pop(key, None)
        always.pop(key, None)
    always[kept] = True
    always.plain = frozenset(plain & {kept})
    return True


def convert_at_forward(module: Any, replace_always_called: bool = False) -> bool:
    """For the wrapped enable function, called as a pre-hook: turn a plain pair (a module quantized
    elsewhere, or unpickled) into a gate. Returns True when the gate takes this forward's hold, False
    when the wrapped function should run as it is."""
    if not isinstance(module, torch.nn.Module):
        return False
    # Already gated: a call from the snapshot of pre-hooks torch took before a conversion, or from a
    # plain pair registered beside the gate; the gate's own pre-hook takes the hold.
    gated = gate_of(module) is not None
    if not install(module, replace_always_called) or gated:
        return gated
    cast(Gate, gate_of(module))._enable_parametrization_cache(module, ())
    return True


def clamped_disable(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A wrapt wrapper of a disable function: never below zero, cache emptied at zero."""
    if P._cache_enabled > 0:
        return wrapped(*args, **kwargs)
    cache.give_back(0)
    return None


@_eager_only
def release_left_behind(added: int) -> int:
    """Give back at most ``added`` holds (the rise during a safety net's step or cell) that nothing live
    owns; returns how many. First this thread's gate holds with no call of their module on its stack,
    then holds no gate accounts for (a plain pair that lost its "off"); never other threads' gate holds."""
    counter = cache.counter()
    budget = min(added, counter)
    if budget <= 0:
        return 0
    modules = (frame.f_locals.get("self") for _, frame in _calls_on_this_thread(_frame()))
    live = collections.Counter(gate_of(m) for m in modules if isinstance(m, torch.nn.Module))
    me, released = threading.get_ident(), 0
    everyone = _every_holds()
    for holds in everyone:
        gate = holds.gate()
        stale = holds.n - (live[gate] if gate is not None else 0)
        if holds.thread == me and stale > 0 and released < budget:
            take = min(stale, budget - released)
            holds.n -= take
            holds.anchor, holds.anchor_n = None, 0
            released += take
    unaccounted = counter - released - sum(holds.n for holds in everyone)
    if unaccounted > 0:
        released += min(unaccounted, budget - released)
    if released:
        cache.give_back(released)
    return released


def forget_holds() -> None:
    """Every gate forgets its holds, on every thread (for :func:`_bnb_gc_fix_cache.reset`)."""
    for holds in _every_holds():
        holds.n = 0
        holds.anchor, holds.anchor_n = None, 0
