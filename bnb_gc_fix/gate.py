"""The cache gate: one forward pre-hook and one always-called forward hook per module.

bitsandbytes 0.48-0.49 switch torch's global parametrization cache on and off around every
forward of a module with 4-bit parametrized parameters, with a plain pair of hooks per
parameter. A forward left by an exception skips the plain forward hook, so the counter
``torch.nn.utils.parametrize._cache_enabled`` never returns to zero and the cache is never
emptied again. The gate replaces that pair with one that is exact and heals itself:

* the pre-hook takes one hold on the counter and records it against (module, thread);
* the forward hook is registered with ``always_call=True``, so it also runs when the forward
  raises an ``Exception`` (non-reentrant checkpointing stops its recompute that way), and it
  releases only a hold that its own module's pre-hook took on the same thread;
* the counter never goes below zero, and the cache is emptied whenever it reaches zero;
* torch runs no forward hook when a ``BaseException`` (``KeyboardInterrupt``) leaves the
  forward. Such a hold is released at the module's next forward on that thread (the gate
  checks the live call stack, so a genuinely nested call of the same module keeps its hold)
  and when the module is garbage-collected;
* one gate per module however many of its parameters are quantized.
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

# One lock for every gate: the counter is one global, and `P._cache_enabled += 1` is not atomic.
_LOCK = threading.Lock()
# Gates of garbage-collected modules whose holds could not be released on the spot (the lock
# was taken, possibly by the very thread the collector interrupted); drained under the lock.
_PENDING: list[Gate] = []
_GATES: weakref.WeakSet[Gate] = weakref.WeakSet()
_get_ident = threading.get_ident
_CALL_IMPL_CODE = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)


def release_locked(count: int) -> None:
    """Give back ``count`` holds on the cache counter, clamped at zero (caller holds the lock)."""
    remaining = P._cache_enabled - count
    if remaining > 0:
        P._cache_enabled = remaining
    else:
        P._cache_enabled = 0
        P._cache = {}


def _drain_locked() -> None:
    while _PENDING:
        _PENDING.pop()._drop_locked()


def _outer_calls(module: torch.nn.Module) -> int:
    """How many calls of ``module`` are live on this thread's stack, besides the current one."""
    if _CALL_IMPL_CODE is None:
        return sys.maxsize  # cannot tell: treat every hold as legitimate
    live = 0
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE and frame.f_locals.get("self") is module:
            live += 1
        frame = frame.f_back
    return max(live - 1, 0)


class Gate:
    """The parametrization-cache gate of one module. Its two bound methods are the hooks."""

    __slots__ = ("__weakref__", "_finalizer", "_held")

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self._finalizer: weakref.finalize | None = None  # type: ignore[type-arg]
        with _LOCK:  # reset() walks the set under the lock
            _GATES.add(self)

    def __reduce__(self) -> tuple[type[Gate], tuple[()]]:
        # A copied or unpickled module gets a fresh gate: holds belong to live calls only.
        return (Gate, ())

    @property
    def held(self) -> int:
        """Holds this gate has on the counter right now, over all threads."""
        return sum(self._held.values())

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: take one hold and switch the cache on."""
        thread = _get_ident()
        with _LOCK:
            if _PENDING:
                _drain_locked()
            held = self._held.get(thread, 0)
            if held:
                stale = held - _outer_calls(module)
                if stale > 0:  # calls left by a BaseException on this thread
                    held -= stale
                    release_locked(stale)
            self._held[thread] = held + 1
            P._cache_enabled += 1
        if self._finalizer is None:
            self.watch(module)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Always-called forward hook: give back the hold this module's pre-hook took."""
        thread = _get_ident()
        with _LOCK:
            held = self._held.get(thread, 0)
            if not held:
                return  # our pre-hook never ran for this call (an earlier pre-hook raised)
            if held == 1:
                del self._held[thread]
            else:
                self._held[thread] = held - 1
            release_locked(1)

    def watch(self, module: torch.nn.Module) -> None:
        """Release this gate's holds when ``module`` is garbage-collected."""
        finalizer = weakref.finalize(module, _forget, self)
        finalizer.atexit = False
        self._finalizer = finalizer

    def _drop_locked(self) -> int:
        held = self.held
        self._held.clear()
        if held:
            release_locked(held)
        return held


def _forget(gate: Gate) -> None:
    # Runs from the garbage collector, possibly in the middle of a locked section of this
    # very thread: never block on the lock, defer to the next gate operation instead.
    if _LOCK.acquire(blocking=False):
        try:
            gate._drop_locked()
        finally:
            _LOCK.release()
    else:
        _PENDING.append(gate)


def _is_ours(hook: Callable[..., Any]) -> bool:
    return isinstance(getattr(hook, "__self__", None), Gate)


def _find_gate(module: torch.nn.Module) -> Gate | None:
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, Gate):
            return owner
    return None


def _named(hook: object, name: str) -> bool:
    # bitsandbytes' functions, wrapt wrappers of them (which forward __name__), and look-alike
    # copies in other libraries (axolotl's moe_quant defines functions of the same names).
    return getattr(hook, "__name__", None) == name and not _is_ours(hook)  # type: ignore[arg-type]


def install(module: torch.nn.Module) -> bool:
    """Replace every plain cache-gate pair on ``module`` with one gate.

    Returns ``True`` when the module changed. A module without a plain enable hook is left
    alone, so calling this twice changes nothing the second time.
    """
    pre_hooks = module._forward_pre_hooks
    enables = [key for key, hook in pre_hooks.items() if _named(hook, ENABLE_NAME)]
    if not enables:
        return False
    post_hooks = module._forward_hooks
    disables = [key for key, hook in post_hooks.items() if _named(hook, DISABLE_NAME)]
    for key in enables:
        del pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in disables:
        del post_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    if _find_gate(module) is None:
        gate = Gate()
        # First among the module's pre-hooks, so no pre-hook of its own can raise before the
        # hold is taken; the forward hook runs whatever happens after that.
        module.register_forward_pre_hook(gate.enter, prepend=True)
        module.register_forward_hook(gate.exit, always_call=True)
        gate.watch(module)
    return True


def gate_of(module: torch.nn.Module) -> Gate | None:
    """The gate installed on ``module``, if any."""
    return _find_gate(module)


def clamped_disable(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """bitsandbytes' ``_disable_parametrization_cache``, never below zero, cache emptied at zero."""
    with _LOCK:
        if P._cache_enabled > 0:
            return wrapped(*args, **kwargs)
        release_locked(0)
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
        _PENDING.clear()
        for gate in list(_GATES):
            gate._held.clear()
        release_locked(released)
    return released
