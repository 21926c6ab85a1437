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

**Threads.** Like torch's own cache, the hot path takes no lock: each hook's read-modify-write
of ``held`` and of the counter is a run of bytecodes with no call in it, which CPython's global
interpreter lock never interrupts. On a free-threaded build (no GIL) the same code runs under a
lock instead.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.nn.utils.parametrize as P

ENABLE_NAME = "_enable_parametrization_cache"
DISABLE_NAME = "_disable_parametrization_cache"

_GATES: weakref.WeakSet[Gate] = weakref.WeakSet()
_CALL_IMPL_CODE = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()
# Serialises what is not on the hot path (healing, reset, new gates), and the hot path itself
# only on a free-threaded build.
_LOCK = threading.RLock()


def _release(count: int) -> int:
    """Give back up to ``count`` holds on the counter, clamped at zero; empty the cache at zero."""
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}
    return count


def _live_calls(module: torch.nn.Module) -> int:
    """Calls of ``module`` live on any thread's stack, the caller's own call included."""
    if _CALL_IMPL_CODE is None:
        return sys.maxsize  # cannot tell: treat every hold as live
    live = 0
    for top in sys._current_frames().values():
        frame: FrameType | None = top
        while frame is not None:
            if frame.f_code is _CALL_IMPL_CODE and frame.f_locals.get("self") is module:
                live += 1
            frame = frame.f_back
    return live


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
        own hold; returns the holds released.
        """
        with _LOCK:
            live = _live_calls(module) - 1  # minus the call being entered
            # Read, compare and write `held` with no call in between: other threads' hooks
            # may have moved it while the stacks were walked, and it must never go negative.
            held = self.held
            stale = held - live
            if stale <= 0:
                return 0
            self.held = live
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


def cached_bytes() -> int:
    """Bytes held by tensors in torch's parametrization cache right now."""
    total = 0
    for tensor in list(P._cache.values()):
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


def reset() -> int:
    """Switch the cache off and empty it; forget every gate's holds. Returns the holds released."""
    with _LOCK:
        released = max(int(P._cache_enabled), 0)
        for gate in list(_GATES):
            gate.held = 0
        _release(released)
    return released
