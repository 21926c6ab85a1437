"""The cache gate: one forward pre-hook and one always-called forward hook per module.

bitsandbytes 0.48-0.49 switch torch's global parametrization cache on and off around every
forward of a module with 4-bit parametrized parameters, with a plain pair of hooks per
parameter. A forward left by an exception skips the plain forward hook, so the counter
``torch.nn.utils.parametrize._cache_enabled`` never returns to zero and the cache is never
emptied again. The gate replaces that pair with one that is exact and heals itself.

**The invariant.** Each gate counts the holds its module's pre-hook took and its forward hook
has not yet given back (``Gate.held``), and every change to ``held`` changes the global counter
by the same amount. So a gate's share of the counter is always exactly ``held``:

* the pre-hook takes one hold; the forward hook, registered with ``always_call=True`` so that it
  also runs when the forward raises an ``Exception`` (non-reentrant checkpointing stops its
  recompute that way), gives one back only if the module holds one: an earlier pre-hook that
  raised never causes a stray release, and the counter never goes below zero;
* the cache is emptied whenever the counter reaches zero;
* torch runs no forward hook when a ``BaseException`` (``KeyboardInterrupt``) leaves the
  forward. Such a hold is released at the module's next forward, which compares ``held`` with
  the calls of the module that are live on the threads' stacks (a genuinely nested or
  concurrent call keeps its hold), and when the module is garbage-collected (the gate dies with
  the module's hook dictionaries and gives back what it still holds);
* one gate per module however many of its parameters are quantized.

**torch.compile.** The two hooks are plain arithmetic on ``held`` and the counter, which Dynamo
traces like bitsandbytes' own pair. What it cannot trace (healing's stack walk, resetting, the
cache-bytes count, the safety nets' release) is kept out of its traces (``_eager_only``): Dynamo
calls it as it is, in a graph break, on the rare forward that enters with holds already taken. The
stack walk knows Dynamo's frames of ``Module._call_impl`` (its transformed copy of the code, and
its resume functions), so a compiled call is a live call too.

**Threads.** Like torch's own cache, the hot path takes no lock: each hook's read-modify-write
of ``held`` and of the counter is a run of bytecodes with no call in it, which CPython's global
interpreter lock never interrupts. On a free-threaded build (no GIL) the same code runs under a
lock instead.
"""

from __future__ import annotations

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

_GATES: weakref.WeakSet[Gate] = weakref.WeakSet()
_CALL_IMPL_CODE = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
# torch.compile runs `_call_impl` as a frame of Dynamo's transformed copy of its code (same name and
# file) or of a resume function named after it; both are live calls of the module too.
_RESUME_PREFIX = "torch_dynamo_resume_in__call_impl"
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
# Serialises what is not on the hot path (healing, reset, new gates), and the hot path itself
# only on a free-threaded build.
_LOCK = threading.RLock()
_F = TypeVar("_F", bound=Callable[..., Any])


def _release(count: int) -> int:
    """Give back up to ``count`` holds on the counter, clamped at zero; empty the cache at zero."""
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}
    return count


def _is_call_impl(code: CodeType) -> bool:
    """Whether a frame's code is ``Module._call_impl``, as eager torch or torch.compile runs it."""
    if code is _CALL_IMPL_CODE:
        return True
    assert _CALL_IMPL_CODE is not None
    if code.co_filename != _CALL_IMPL_CODE.co_filename:
        return False
    return code.co_name == _CALL_IMPL_CODE.co_name or code.co_name.startswith(_RESUME_PREFIX)


def _live_modules() -> Iterator[object]:
    """The module of every ``Module._call_impl`` frame on any thread's stack (one per live call)."""
    if _CALL_IMPL_CODE is None:
        return
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            if _is_call_impl(frame.f_code):
                yield frame.f_locals.get("self")
            frame = frame.f_back


def _live_calls(module: torch.nn.Module) -> int:
    """Calls of ``module`` live on any thread's stack, the caller's own call included."""
    if _CALL_IMPL_CODE is None:
        return sys.maxsize  # cannot tell: treat every hold as live
    return sum(1 for live in _live_modules() if live is module)


def _eager_only(function: _F) -> _F:
    """Keep ``function`` out of torch.compile's traces: Dynamo calls it as it is, in a graph break.

    Healing walks the threads' stacks and resetting touches every gate: neither can be traced,
    and both are rare (a forward entered with holds already taken, a release by hand).
    """
    try:
        disable = getattr(getattr(torch, "compiler", None), "disable", None)
        if disable is None:
            from torch import _dynamo

            disable = _dynamo.disable
        return cast(_F, disable(function))
    except Exception:  # a torch without a usable compiler: nothing traces it there
        return function


class Gate:
    """The parametrization-cache gate of one module. Its two bound methods are the hooks."""

    __slots__ = ("__weakref__", "held")

    def __init__(self) -> None:
        self.held = 0
        """Holds this module's pre-hook took that its forward hook has not given back."""
        with _LOCK:  # reset() walks the set under the lock
            _GATES.add(self)

    def __reduce__(self) -> tuple[type[Gate], tuple[()]]:
        # A copied or unpickled module gets a fresh gate: holds belong to live calls only.
        return (Gate, ())

    def __del__(self) -> None:
        # The module (or its hooks) went away: nothing can give these holds back any more.
        try:
            held = self.held
            if held:
                self.held = 0
                _release(held)
        except Exception:  # at interpreter shutdown torch may already be gone
            pass

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: take one hold and switch the cache on."""
        if self.held:
            self.heal(module)
        self.held += 1
        P._cache_enabled += 1

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Always-called forward hook: give back one hold, if this module's pre-hook took one."""
        # _release(1) inlined: a call here would cost time and open a gap for a thread switch.
        if self.held:
            self.held -= 1
            remaining = P._cache_enabled - 1
            if remaining > 0:
                P._cache_enabled = remaining
            else:
                P._cache_enabled = 0
                P._cache = {}

    def heal(self, module: torch.nn.Module) -> int:
        """Release holds of calls that are no longer on any stack (left by a BaseException).

        Called by the pre-hook when the module already holds something, before it takes its
        own hold; returns the holds released. Never traced by torch.compile (see
        :func:`_heal`).
        """
        return _heal(self, module)


@_eager_only
def _heal(gate: Gate, module: torch.nn.Module) -> int:
    with _LOCK:
        live = max(_live_calls(module) - 1, 0)  # minus the call being entered
        # Read, compare and write `held` with no call in between: other threads' hooks
        # may have moved it while the stacks were walked, and it must never go negative.
        held = gate.held
        stale = held - live
        if stale <= 0:
            return 0
        gate.held = live
        return _release(stale)


class _LockedGate(Gate):
    """The gate for free-threaded Python builds, where the hot path needs the lock."""

    __slots__ = ()

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        with _LOCK:
            super().enter(module, args)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with _LOCK:
            super().exit(module, args, output)

    def __reduce__(self) -> tuple[type[Gate], tuple[()]]:
        return (_LockedGate, ())

    def __del__(self) -> None:
        with _LOCK:
            super().__del__()


_GATE_CLASS: type[Gate] = Gate if _GIL else _LockedGate


def _is_ours(hook: object) -> bool:
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
    return getattr(hook, "__name__", None) == name and not _is_ours(hook)


def cache_hooks(module: torch.nn.Module) -> tuple[list[int], list[int], bool]:
    """The module's cache pair hooks that are not ours, matched by function name.

    Returns the keys of the enable pre-hooks, the keys of the disable forward hooks, and whether
    there are disable hooks and every one of them is always-called (upstream's fix).
    """
    enables = [key for key, hook in module._forward_pre_hooks.items() if _named(hook, ENABLE_NAME)]
    disables = [key for key, hook in module._forward_hooks.items() if _named(hook, DISABLE_NAME)]
    always_called = bool(disables) and all(key in module._forward_hooks_always_called for key in disables)
    return enables, disables, always_called


def install(module: torch.nn.Module, replace_always_called: bool = False) -> bool:
    """Replace every plain cache-gate pair on ``module`` with one gate.

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
    pre_hooks = module._forward_pre_hooks
    post_hooks = module._forward_hooks
    for key in enables:
        del pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in disables:
        del post_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    if gate_of(module) is None:
        gate = _GATE_CLASS()
        # First among the module's pre-hooks, so no pre-hook of its own can raise before the
        # hold is taken; the forward hook runs whatever happens after that.
        module.register_forward_pre_hook(gate.enter, prepend=True)
        module.register_forward_hook(gate.exit, always_call=True)
    return True


def clamped_disable(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """bitsandbytes' ``_disable_parametrization_cache``, never below zero, cache emptied at zero."""
    with _LOCK:
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


def _live_calls_by_gate() -> dict[Gate, int]:
    """For every gated module with a call live on some thread's stack: how many such calls."""
    if _CALL_IMPL_CODE is None:  # cannot tell: treat every hold as live
        return {gate: gate.held for gate in list(_GATES)}
    live: dict[Gate, int] = {}
    for module in _live_modules():
        gate = gate_of(module) if isinstance(module, torch.nn.Module) else None
        if gate is not None:
            live[gate] = live.get(gate, 0) + 1
    return live


@_eager_only
def release_left_behind(added: int) -> int:
    """Give back at most ``added`` holds that nothing live owns; returns how many it gave back.

    For the safety nets (``guard()``, the Trainer callback, the notebook cell-end release), which
    pass how much the counter rose during their step or cell: holds taken before it began (a
    ``P.cached()`` block of another thread, a hold kept across cells) are never theirs to give.
    First the stale holds of gates (their module has no call on any thread's stack: a forward left
    by a ``BaseException``), then holds no gate accounts for (a plain pair that lost its "off",
    bitsandbytes unpatched or a look-alike copy). Holds of live gated calls are never given back,
    and the counter never goes below zero.
    """
    with _LOCK:
        counter = int(P._cache_enabled)
        budget = min(added, counter)
        if budget <= 0:
            return 0
        live = _live_calls_by_gate()
        released = 0
        for gate in list(_GATES):
            stale = gate.held - live.get(gate, 0)
            if stale > 0 and released < budget:
                take = min(stale, budget - released)
                gate.held -= take
                released += take
        unaccounted = counter - released - sum(gate.held for gate in list(_GATES))
        if unaccounted > 0:
            released += min(unaccounted, budget - released)
        if released:
            _release(released)
        return released


@_eager_only
def reset() -> int:
    """Switch the cache off and empty it; forget every gate's holds. Returns the holds released."""
    with _LOCK:
        released = max(int(P._cache_enabled), 0)
        for gate in list(_GATES):
            gate.held = 0
        _release(released)
    return released
