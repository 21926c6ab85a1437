"""The cache gate: the one pair of hooks per module that takes the place of bitsandbytes' plain pairs.

bitsandbytes 0.48-0.49 switch torch's global parametrization cache on and off around every
forward of a module with 4-bit parametrized parameters, with a plain pair of hooks per
parameter. A forward left by an exception skips the plain forward hook, so the counter
``torch.nn.utils.parametrize._cache_enabled`` never returns to zero and the cache is never
emptied again. The gate replaces that pair with one that is exact and heals itself.

**The invariant.** Each gate counts, per thread, the holds its module's pre-hook took on that
thread and its forward hook has not yet given back (:class:`_Holds`), and every change to such a
count changes the global counter by the same amount. So a gate's share of the counter is always
exactly what it holds:

* the pre-hook takes one hold; the forward hook, registered with ``always_call=True`` so that it
  also runs when the forward raises an ``Exception`` (non-reentrant checkpointing stops its
  recompute that way), gives one back only if its module holds one on this thread: an earlier
  pre-hook that raised never causes a stray release, and the counter never goes below zero;
* the cache is emptied whenever the counter reaches zero;
* torch runs no forward hook when a ``BaseException`` (``KeyboardInterrupt``) leaves the forward.
  Such a hold is found at the module's next forward on the same thread: only a thread that already
  holds the module when it enters it can hold a stale hold (a self-call holds it too), and only then
  are that thread's own frames read, from the top down and only until every hold is accounted for
  by a live call. Holds are also given back when their module is garbage-collected, when their
  thread ends, and in a forked child for every thread but the one that forked (the interpreter
  drops the other threads' thread-local holds there);
* one gate per module however many of its parameters are quantized, and it sits where the pair it
  replaces sat: its pre-hook in the place of the first enable hook, its forward hook in the place of
  the last disable hook, so every other hook of the module runs exactly when it ran before relative
  to the cache switching on and off.

**Saving and loading.** The gate's hooks are methods named like the functions they replace, and a
gate pickles as the module those functions came from (``bitsandbytes.nn.parametrize``), so a pickled
module holds the plain pair again: it loads wherever the control's pickle loads, without this
package. Where the fix is active, bitsandbytes' enable function is wrapped (:mod:`bnb_gc_fix.patch`)
and turns such a plain pair into a gate at its first forward. ``copy.deepcopy`` gives a copy a fresh
gate of its own.

**torch.compile.** The two hooks are plain arithmetic on the thread's count and the counter, which
Dynamo traces like bitsandbytes' own pair (a ``threading.local`` attribute, guarded by type and
value, not by thread). What it cannot trace (healing's stack walk, resetting, the cache-bytes count,
the safety nets' release) is kept out of its traces (``_eager_only``): Dynamo calls it as it is, in a
graph break, when a module enters with holds already taken on its thread. The walk knows Dynamo's
frames of ``Module._call_impl`` (its transformed copy of the code, and its resume functions), so a
compiled call is a live call too.

**Threads.** No lock, and no work another thread's call can cause: a thread only ever reads and
writes its own counts. Like torch's own cache, the global counter's read-modify-write is a run of
bytecodes with no call in it, which the GIL never interrupts on Python 3.10 and later. On Python 3.9
the interpreter may switch threads between any two bytecodes, so there, as for bitsandbytes' pair and
``P.cached()``, two threads updating the counter at the same instant can lose an update. On a
free-threaded build (no GIL) the counter's update takes a lock, made anew in a forked child.
"""

from __future__ import annotations

import collections
import importlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any, TypeVar, cast

import torch
import torch.nn.utils.parametrize as P

ENABLE_NAME = "_enable_parametrization_cache"
DISABLE_NAME = "_disable_parametrization_cache"
ORIGIN = "bitsandbytes.nn.parametrize"

_CALL_IMPL = torch.nn.Module._call_impl.__code__
# torch.compile runs `_call_impl` as a frame of Dynamo's transformed copy of its code (same name and
# file) or of a resume function named after it; both are live calls of the module too.
_RESUME_PREFIX = "torch_dynamo_resume_in__call_impl"
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
_frame = sys._getframe  # CPython's frame access (inspect.currentframe() is this, one frame up)
_F = TypeVar("_F", bound=Callable[..., Any])
# True where Dynamo traces the caller (it folds the call to a constant), False elsewhere.
_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", None) or (
    lambda: bool(torch._dynamo.is_compiling())  # torch < 2.3
)


def _release(count: int) -> None:
    """Give back up to ``count`` holds on the counter, clamped at zero; empty the cache at zero."""
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}


def _eager_only(function: _F) -> _F:
    """Keep ``function`` out of torch.compile's traces: Dynamo calls it as it is, in a graph break."""
    try:
        return cast(_F, torch.compiler.disable(function))  # type: ignore[no-untyped-call]
    except Exception:  # a torch without a usable compiler: nothing traces it there
        return function


class _Holds:
    """One thread's holds on one gate. Given back when it dies: its thread ended, its gate (module)
    was collected, or a forked child dropped the thread it belonged to."""

    __slots__ = ("__weakref__", "anchor", "anchor_depth", "anchor_n", "gate", "n", "thread")

    def __init__(self, gate: weakref.ref[Gate]) -> None:
        self.n = 0
        self.gate = gate
        self.thread = threading.get_ident()
        self.anchor: FrameType | None = None
        """The innermost live call that holds one of the first ``anchor_n`` holds, when a walk last
        found all of them live; while it is on the stack, so are they (see :func:`_walk`)."""
        self.anchor_n = 0
        self.anchor_depth = 0

    def forget_anchor(self) -> None:
        self.anchor = None
        self.anchor_n = 0

    def __del__(self) -> None:
        try:
            held, self.n = self.n, 0
            if held:
                _release(held)
        except Exception:  # at interpreter shutdown torch may already be gone
            pass


_HOLDS: weakref.WeakSet[_Holds] = weakref.WeakSet()
"""Every thread's holds on every gate (for reset() and the safety nets' release)."""


def _every_holds() -> list[_Holds]:
    """A snapshot of :data:`_HOLDS`: another thread's first forward of a gate may add to it meanwhile."""
    while True:
        try:
            return list(_HOLDS)
        except RuntimeError:  # "Set changed size during iteration": take it again
            continue


class _PerThread(threading.local):
    holds: _Holds

    def __init__(self, gate: weakref.ref[Gate]) -> None:  # runs once in every thread that uses it
        self.holds = _Holds(gate)
        _HOLDS.add(self.holds)


class Gate:
    """The parametrization-cache gate of one module. Its two bound methods are the hooks."""

    __slots__ = ("__weakref__", "origin", "threads")

    def __init__(self, origin: str = ORIGIN) -> None:
        self.origin = origin
        """The module whose plain pair this gate replaced: what its hooks pickle as."""
        self.threads = _PerThread(weakref.ref(self))

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        # Pickled as the module the replaced functions live in: a pickled hook `gate.<name>` is
        # loaded as `getattr(that module, <name>)`, the plain function this gate replaced.
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
        # _release(1) inlined: a call here would cost time and open a gap for a thread switch.
        if held:
            holds.n = held - 1
            if held <= holds.anchor_n:  # the anchored call has ended: let its frame go (no call here,
                holds.anchor = None  # so no Ctrl-C can land between the count and the counter)
                holds.anchor_n = 0
            remaining = P._cache_enabled - 1
            if remaining > 0:
                P._cache_enabled = remaining
            else:
                P._cache_enabled = 0
                P._cache = {}


_LOCK = threading.RLock()


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
    """A forked child has one thread: only its holds are live. The interpreter drops the other
    threads' thread-local holds itself; this also covers one that a paused frame still referred to."""
    global _LOCK
    _LOCK = threading.RLock()  # never wait on a lock one of the parent's threads held
    try:
        me = threading.get_ident()
        for holds in _every_holds():
            if holds.thread != me:
                held, holds.n = holds.n, 0
                holds.forget_anchor()
                if held:
                    _release(held)
    except Exception:  # never disturb a fork
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_GATE: type[Gate] = Gate if _GIL else _LockedGate


def _is_call_impl(code: CodeType) -> bool:
    """Whether a frame's code is ``Module._call_impl``, as eager torch or torch.compile runs it."""
    if code is _CALL_IMPL:
        return True
    if code.co_filename != _CALL_IMPL.co_filename:
        return False
    return code.co_name == _CALL_IMPL.co_name or code.co_name.startswith(_RESUME_PREFIX)


def _calls_on_this_thread(frame: FrameType | None) -> Iterator[tuple[int, FrameType]]:
    """Every ``Module._call_impl`` frame from ``frame`` down this thread's stack, innermost first,
    with how many frames below ``frame`` it is."""
    depth = 0
    while frame is not None:
        if _is_call_impl(frame.f_code):
            yield depth, frame
        frame = frame.f_back
        depth += 1


@_eager_only
def _walk(module: torch.nn.Module, holds: _Holds, start: FrameType | None) -> None:
    """Give back this thread's holds on ``module`` that no live call of it on this thread owns.

    Called by the pre-hook (whose frame is ``start``) when the thread already holds the module: a
    self-call (live) or a call left by a BaseException (stale). This thread's stack is walked from
    the top down, only until every hold is accounted for. The innermost holding call found is
    remembered with how deep it sits below the pre-hook: while the holds stay the same and that frame
    is still there (one look at a known depth), every hold is live, so a module that calls itself
    again and again is walked once, not once per call.
    """
    held = holds.n
    holds.forget_anchor()
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
    live = max(live, 0)
    holds.anchor_n = live  # the anchor, if one was found, is the innermost of these live holds
    holds.n = live
    _release(held - live)


def _is_gate_hook(hook: object) -> bool:
    return isinstance(getattr(hook, "__self__", None), Gate)


def gate_of(module: torch.nn.Module) -> Gate | None:
    """The gate installed on ``module``, if any."""
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, Gate):
            return owner
    return None


def _named(hook: object, name: str) -> bool:
    # bitsandbytes' functions, wrapt wrappers of them (which forward __name__), and look-alike
    # copies in other libraries (axolotl's moe_quant defines functions of the same names).
    return getattr(hook, "__name__", None) == name and not _is_gate_hook(hook)


def cache_hooks(module: torch.nn.Module) -> tuple[list[int], list[int], bool]:
    """The module's cache pair hooks that are not ours, matched by function name, in order.

    Returns the keys of the enable pre-hooks, the keys of the disable forward hooks, and whether
    there are disable hooks and every one of them is always-called (upstream's fix).
    """
    enables = [key for key, hook in module._forward_pre_hooks.items() if _named(hook, ENABLE_NAME)]
    disables = [key for key, hook in module._forward_hooks.items() if _named(hook, DISABLE_NAME)]
    always_called = bool(disables) and all(key in module._forward_hooks_always_called for key in disables)
    return enables, disables, always_called


class _AlwaysCalled(collections.OrderedDict):  # type: ignore[type-arg]
    """A module's ``_forward_hooks_always_called`` that pickles without the gate's entry where the pair
    it replaced was plain, so a pickled module holds exactly the pair it had before the fix."""

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
    wanted = set(keys)
    order = [key for key in hooks if key in wanted]
    keep = order[0] if first else order[-1]
    for key in order:
        if key != keep:
            del hooks[key]
    hooks[keep] = hook  # assigning to an existing key keeps its place
    return keep


def install(module: torch.nn.Module, replace_always_called: bool = False) -> bool:
    """Replace every plain cache-gate pair on ``module`` with its one gate, in the pair's places.

    Returns ``True`` when the module changed. A module without an enable hook is left alone, so
    calling this twice changes nothing the second time. So is a module whose pairs are already
    right (each disable hook always-called: bitsandbytes 0.50, axolotl 0.20), unless
    ``replace_always_called`` (``BNB_GC_FIX=force``: the gate also heals a Ctrl-C).
    """
    enables, disables, always_called = cache_hooks(module)
    if not enables:
        return False
    if always_called and len(disables) == len(enables) and not replace_always_called:
        return False
    gate = gate_of(module)
    if gate is None:
        first = module._forward_pre_hooks[enables[0]]
        gate = _GATE(getattr(first, "__module__", None) or ORIGIN)
    enter, leave = gate._enable_parametrization_cache, gate._disable_parametrization_cache
    pre_hooks, post_hooks = module._forward_pre_hooks, module._forward_hooks
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
    """For the wrapped enable function, called as a pre-hook: turn a plain pair into a gate.

    A module quantized and pickled elsewhere, or loaded from a pickle of a gated module, holds the
    plain pair; where the fix is active the enable function is ours and calls this at the module's
    first forward. Returns True when the call is taken care of (the gate took this forward's hold, or
    the module's own gate runs in this forward), False when the wrapped function should run as it is.
    """
    if not isinstance(module, torch.nn.Module):
        return False
    had_gate = gate_of(module) is not None
    converted = install(module, replace_always_called)
    if had_gate:
        # This call comes from the snapshot of pre-hooks torch took before a conversion, or from a
        # plain pair registered beside the gate: the gate's own pre-hook takes the hold.
        return True
    if converted:
        gate = gate_of(module)
        assert gate is not None
        gate._enable_parametrization_cache(module, ())
        return True
    return False


def clamped_disable(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """bitsandbytes' ``_disable_parametrization_cache``, never below zero, cache emptied at zero."""
    if P._cache_enabled > 0:
        return wrapped(*args, **kwargs)
    _release(0)
    return None


def counter() -> int:
    """torch's parametrization cache counter (``P._cache_enabled``)."""
    return int(P._cache_enabled)


@_eager_only
def cached_bytes() -> int:
    """Bytes held by tensors in torch's parametrization cache right now."""
    total = 0
    for tensor in list(P._cache.values()):
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


@_eager_only
def release_left_behind(added: int) -> int:
    """Give back at most ``added`` holds that nothing live owns; returns how many it gave back.

    For the safety nets (``guard()``, the Trainer callback, the notebook cell-end release), which
    pass how much the counter rose during their step or cell: holds taken before it began (a
    ``P.cached()`` block of another thread, a hold kept across cells) are never theirs to give.
    First this thread's stale holds of gates (their module has no call on this thread's stack: a
    forward left by a ``BaseException``), then holds no gate accounts for (a plain pair that lost
    its "off", bitsandbytes unpatched or a look-alike copy). Other threads' gate holds belong to
    their live calls and are never given back, and the counter never goes below zero.
    """
    counter = int(P._cache_enabled)
    budget = min(added, counter)
    if budget <= 0:
        return 0
    live: dict[Gate, int] = {}
    for _, frame in _calls_on_this_thread(sys._getframe()):
        module = frame.f_locals.get("self")
        gate = gate_of(module) if isinstance(module, torch.nn.Module) else None
        if gate is not None:
            live[gate] = live.get(gate, 0) + 1
    me = threading.get_ident()
    released = 0
    everyone = _every_holds()
    for holds in everyone:
        gate = holds.gate()
        stale = holds.n - (live.get(gate, 0) if gate is not None else 0)
        if holds.thread == me and stale > 0 and released < budget:
            take = min(stale, budget - released)
            holds.n -= take
            holds.forget_anchor()
            released += take
    unaccounted = counter - released - sum(holds.n for holds in everyone)
    if unaccounted > 0:
        released += min(unaccounted, budget - released)
    if released:
        _release(released)
    return released


@_eager_only
def reset() -> int:
    """Switch the cache off and empty it; forget every gate's holds. Returns the holds released."""
    released = max(int(P._cache_enabled), 0)
    for holds in _every_holds():
        holds.n = 0
        holds.forget_anchor()
    _release(released)
    return released
