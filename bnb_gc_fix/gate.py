"""The gate: one pair of hooks per module, in the place of bitsandbytes' plain pairs.

bitsandbytes 0.48-0.49 switch torch's parametrization cache on and off around every forward of a
quantized module with a plain pair of hooks per parameter. A forward left by an exception skips the
"off", so the cache is never emptied again. A gate's pre-hook (:class:`EnterHook`) takes one *hold* on
torch's counter and notes the call that took it; its always-called forward hook (:class:`LeaveHook`)
gives one back. torch runs always-called hooks after an ``Exception``, but not after a
``BaseException`` such as ``KeyboardInterrupt``: a hold such a forward left behind is found and given
back (:func:`_heal`) at the module's next forward on that thread, when its module is collected, when
its thread ends, or when a forked child drops its parent's other threads.

How a hold is known to be live: each hold remembers the frame that called the pre-hook (torch's
``Module._call_impl``, or the function in it that runs the hooks). A hold is live while that frame is on
the thread's stack. Holds nest (an inner self-call's after the outer one's), so the innermost live hold
vouches for every one before it, and a self-call checks one frame a few levels down: the cost does not
depend on how deep the calls nest, nor on how ``Module.__call__`` is wrapped. Where torch.compile traces
the pre-hook there is no frame to take (reading one would break the graph): such a hold is counted
against the compiled ``_call_impl`` frames of its module instead, outside the trace.

The counter's update has no call in it, so the GIL never switches threads in the middle of it (3.10+);
free-threaded builds take a lock instead (:class:`LockedEnterHook`, :class:`LockedLeaveHook`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import pkgutil
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar, cast

import torch
import torch.nn.utils.parametrize as P

import _bnb_gc_fix_cache as cache

_frame = sys._getframe
_F = TypeVar("_F", bound=Callable[..., Any])
_GIL = cache.gil_enabled()
_LOCK = threading.RLock()  # taken by the hooks of a free-threaded build

#: How the frames torch.compile runs ``Module._call_impl`` as are recognised: Dynamo's copy of its code
#: (the same name and file, another code object) or one of its resume functions. The file is read from a
#: method nobody wraps; the eager code object is the one a hold's frame already accounts for.
_MODULE_FILE = torch.nn.Module.register_forward_hook.__code__.co_filename
_CALL_IMPL_NAME = "_call_impl"
_RESUME_PREFIX = "torch_dynamo_resume_in__call_impl"
_EAGER_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _legacy_compiling() -> bool:  # torch < 2.3
    return bool(torch._dynamo.is_compiling())


#: True where Dynamo traces the caller (it folds the call to a constant), False elsewhere.
_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", None) or _legacy_compiling


def eager_only(function: _F) -> _F:
    """Keep ``function`` out of torch.compile's traces: Dynamo calls it as it is, in a graph break."""
    try:
        return cast(_F, torch.compiler.disable(function))  # type: ignore[no-untyped-call]
    except Exception:  # a torch without a usable compiler: nothing traces it there
        return function


# --- holds -------------------------------------------------------------------------------------------
class Holds:
    """One thread's holds on one gate: for each, the frame of the call that took it (None where
    torch.compile traced the pre-hook), outermost first. Given back when it dies: its thread ended, or
    its module was collected."""

    __slots__ = ("__weakref__", "calls", "gate", "spacing", "thread")

    def __init__(self, gate: weakref.ref[Gate]) -> None:
        self.calls: list[FrameType | None] = []
        self.gate = gate
        self.thread = threading.get_ident()
        # How many frames below a pre-hook's caller the innermost hold's frame was at the last
        # self-call: where :func:`_running` looks first.
        self.spacing = 0

    def forget(self, count: int) -> int:
        """Forget the innermost ``count`` holds (all of them, at most) without giving them back to
        torch's counter; returns how many were forgotten."""
        count = max(min(count, len(self.calls)), 0)
        del self.calls[len(self.calls) - count :]
        return count

    def give_back(self, count: int) -> None:
        """Give back the innermost ``count`` holds (all of them, at most)."""
        forgotten = self.forget(count)
        if forgotten:
            cache.give_back(forgotten)

    def __del__(self) -> None:
        try:
            self.give_back(len(self.calls))
        except Exception:  # at interpreter shutdown
            pass


_HOLDS: weakref.WeakSet[Holds] = weakref.WeakSet()  # every thread's holds on every gate


def every_holds() -> list[Holds]:
    """A snapshot of every thread's holds on every gate (another thread's first forward may add one)."""
    while True:
        with contextlib.suppress(RuntimeError):  # "Set changed size during iteration": take it again
            return list(_HOLDS)


class _PerThread(threading.local):
    """A gate's holds on the thread that reads it; ``calls`` is ``holds.calls``, one attribute fewer on
    the hot path."""

    def __init__(self, gate: weakref.ref[Gate]) -> None:  # runs once in every thread that uses it
        self.holds = Holds(gate)
        self.calls = self.holds.calls
        _HOLDS.add(self.holds)


def forget_holds() -> None:
    """Every gate forgets its holds on every thread, giving nothing back (the counter was reset)."""
    for holds in every_holds():
        holds.calls.clear()


cache.on_reset(forget_holds)


def _after_fork_in_child() -> None:
    """A forked child has one thread: give back every other thread's holds (also one a frame keeps)."""
    global _LOCK
    _LOCK = threading.RLock()  # never wait on a lock one of the parent's threads held
    with contextlib.suppress(Exception):  # never disturb a fork
        me = threading.get_ident()
        for holds in every_holds():
            if holds.thread != me:
                holds.give_back(len(holds.calls))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- which holds are live ----------------------------------------------------------------------------
def stack_from(start: FrameType | None) -> Iterator[FrameType]:
    """``start`` and every frame below it on this thread."""
    frame = start
    while frame is not None:
        yield frame
        frame = frame.f_back


def _running(holds: Holds, start: FrameType, offset: int) -> bool:
    """Whether the innermost hold's call is still running: its frame is on the stack below ``start``,
    the caller of the pre-hook, which is ``offset`` frames below this function's own.

    A module calling itself takes its holds a fixed number of frames apart, so the frame is looked for
    first where it was at the last self-call (one step of the interpreter's own, ``sys._getframe``);
    only when it is not there is the stack read down, frame by frame, and the spacing learnt (for a
    hold a ``BaseException`` left, the whole stack, once here and once in :func:`_heal`). Either
    way a frame is found only if it is on this thread's stack, so the answer is exact. False for a hold
    taken in a compiled trace (no frame): :func:`_heal` then counts the compiled calls instead.
    """
    owner = holds.calls[-1]
    if owner is None:
        return False
    try:
        if _frame(offset + holds.spacing) is owner:
            return True
    except ValueError:  # the stack is not that deep now
        pass
    spacing = 0
    frame: FrameType | None = start
    while frame is not None:
        if frame is owner:
            holds.spacing = spacing
            return True
        frame = frame.f_back
        spacing += 1
    return False


def _runs_compiled_call_impl(frame: FrameType) -> bool:
    """Whether ``frame`` runs ``Module._call_impl`` as torch.compile made it (never the eager code,
    whose calls the holds' frames already account for)."""
    code = frame.f_code
    if code.co_filename != _MODULE_FILE or code is _EAGER_CALL_IMPL:
        return False
    return code.co_name == _CALL_IMPL_NAME or code.co_name.startswith(_RESUME_PREFIX)


def _compiled_calls(stack: list[FrameType], gate: Gate) -> int:
    """How many compiled calls of ``gate``'s module run on ``stack``."""
    count = 0
    for frame in stack:
        if _runs_compiled_call_impl(frame) and Gate.of(frame.f_locals.get("self")) is gate:
            count += 1
    return count


def live_holds(holds: Holds, stack: list[FrameType], entering_compiled: bool = False) -> int:
    """How many of ``holds`` (outermost first) belong to calls still running on ``stack``.

    A hold with a frame is live while its frame is on the stack; a hold taken in a compiled trace is
    live while a compiled call of its module is (``entering_compiled``: the innermost of those is the
    call being entered, which holds nothing yet). Holds nest, so the first one found ended ends the
    count: every hold after it was taken inside its call.
    """
    gate = holds.gate()
    on_stack = {id(frame) for frame in stack}
    unclaimed: int | None = None  # compiled calls not yet matched to a hold, counted when first needed
    live = 0
    for owner in holds.calls:
        if owner is None:
            if unclaimed is None:
                unclaimed = 0 if gate is None else _compiled_calls(stack, gate) - int(entering_compiled)
            if unclaimed <= 0:
                break
            unclaimed -= 1
        elif id(owner) not in on_stack:
            break
        live += 1
    return live


@eager_only
def _heal(holds: Holds, entering: FrameType | None) -> None:
    """Give back this thread's holds on a gate whose calls have ended (left by a ``BaseException``).

    Called by the pre-hook when the innermost hold's call is no longer running, with the frame of the
    call being entered; or, where torch.compile traced the pre-hook, with None, in a graph break: the
    stack then starts at this function's caller.
    """
    start = _frame(1) if entering is None else entering
    stack = list(stack_from(start))
    live = live_holds(holds, stack, entering_compiled=entering is None)
    holds.give_back(len(holds.calls) - live)


# --- the gate and its two hooks ----------------------------------------------------------------------
class Gate:
    """What one module's two hooks share: every thread's holds on this module."""

    __slots__ = ("__weakref__", "threads")

    def __init__(self) -> None:
        self.threads = _PerThread(weakref.ref(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> Gate:
        return type(self)()  # a copied module gets a fresh gate: holds belong to live calls

    @staticmethod
    def of(module: object) -> Gate | None:
        """The gate on ``module``, if it has one."""
        hooks = getattr(module, "_forward_pre_hooks", None)
        if not isinstance(module, torch.nn.Module) or hooks is None:
            return None
        for hook in hooks.values():
            if isinstance(hook, EnterHook):
                return hook.gate
        return None


class _Hook:
    """One of a gate's two hooks. It pickles (with pickle, cloudpickle or dill) as the function it
    replaced, by name, so a pickled module loads wherever the original did, with the package or
    without it, and holds a plain pair there (which the patch turns into a gate at its first forward)."""

    __slots__ = ("gate", "replaced", "threads")

    def __init__(self, gate: Gate, replaced: str) -> None:
        self.gate = gate
        self.threads = gate.threads  # one attribute fewer on the hot path
        self.replaced = replaced  # "module:qualified name" of the function this hook replaced

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        return (pkgutil.resolve_name, (self.replaced,))

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return type(self)(copy.deepcopy(self.gate, memo), self.replaced)

    def __repr__(self) -> str:
        return f"<bnb_gc_fix {type(self).__name__} in the place of {self.replaced}>"


class EnterHook(_Hook):
    """The gate's forward pre-hook: take one hold on this thread and switch the cache on."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any, caller: FrameType | None = None) -> None:
        calls = self.threads.calls
        if _compiling():
            if calls:  # a self-call, or a hold left by a BaseException
                _heal(self.threads.holds, None)
            calls.append(None)
        else:
            owner = caller or _frame(1)
            if calls and not _running(self.threads.holds, owner, offset=2):  # that call has ended
                _heal(self.threads.holds, owner)
            calls.append(owner)
        P._cache_enabled += 1


class LeaveHook(_Hook):
    """The gate's always-called forward hook: give back one hold, if this thread has one here."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        calls = self.threads.calls
        if not calls:
            return
        calls.pop()
        # cache.give_back(1) written out: a call costs time and lets a thread switch in between.
        remaining = P._cache_enabled - 1
        if remaining > 0:
            P._cache_enabled = remaining
        else:
            P._cache_enabled = 0
            P._cache = {}


class LockedEnterHook(EnterHook):
    """The pre-hook of a free-threaded build, where the counter's update needs a lock."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any, caller: FrameType | None = None) -> None:
        if caller is None and not _compiling():
            caller = _frame(1)
        with _LOCK:
            super().__call__(module, args, caller)


class LockedLeaveHook(LeaveHook):
    """The forward hook of a free-threaded build."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with _LOCK:
            super().__call__(module, args, output)


def new_hooks(enable_replaced: str, disable_replaced: str) -> tuple[EnterHook, LeaveHook]:
    """A fresh gate's two hooks, standing in for the functions named (``"module:name"``)."""
    gate = Gate()
    if _GIL:
        return EnterHook(gate, enable_replaced), LeaveHook(gate, disable_replaced)
    return LockedEnterHook(gate, enable_replaced), LockedLeaveHook(gate, disable_replaced)
