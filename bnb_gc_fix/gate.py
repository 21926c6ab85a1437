"""The gate: one pair of hooks per quantized module, in the place of bitsandbytes' plain pairs.

bitsandbytes 0.48-0.49 switch torch's parametrization cache on and off around every forward of a
quantized module with a plain pair of hooks per parameter; a forward left by an exception skips the
"off", and the cache is never emptied again. A gate's pre-hook (:class:`EnterHook`) takes one *hold*
on torch's counter; its always-called forward hook (:class:`LeaveHook`) gives it back. torch runs
always-called hooks after an ``Exception`` (non-reentrant checkpointing's early stop among them), but
no hook at all after a ``BaseException`` such as ``KeyboardInterrupt``. A hold such a forward left
behind is given back at the module's next re-entry on that thread, when the module is collected, when
its thread ends (a forked child's other threads too), or by a safety net (:func:`give_back_ended`).

Each hold remembers the frame that called the pre-hook (torch's ``Module._call_impl``, or the function
in it that runs the hooks); the call is running while that frame is on its thread's stack. That is
read only at a *re-entry*, when a pre-hook finds its thread already holding the module: a module
calling itself finds the outer call's frame a few frames down, whatever the depth; a hold whose frame
is gone is given back. Where torch.compile
traces the pre-hook there is no frame to take (reading one would break the graph): such a hold is
given back at the module's next re-entry, which makes a compiled module that calls itself dequantize
again in its inner calls, never leak.

Holds nest: a thread takes a hold on a module inside the calls of the ones it holds already, so the
live holds come first and the ended ones last. The counter's update has no call in it, so a thread
with the GIL never switches in the middle of it (Python 3.10+), as in torch's own ``P.cached()``.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import pkgutil
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Optional

import torch
import torch.nn.utils.parametrize as P

from _bnb_gc_fix import cache

_frame = sys._getframe


def _never_compiling() -> bool:  # a torch before torch.compiler.is_dynamo_compiling (2.3)
    return False


#: True where Dynamo traces the caller (it folds the call to a constant), False in eager mode.
_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", _never_compiling)


# --- holds -------------------------------------------------------------------------------------------
#: One thread's holds on one gate, outermost first: for each, the frame of the call that took it (None
#: where torch.compile traced the pre-hook). A plain list: the hooks' hot path.
Holds = list[Optional[FrameType]]


class ThreadHolds:
    """One thread's holds on one gate, as :func:`all_thread_holds` lists them. What is left in them
    when this dies (with the thread's copy of the gate: its thread ended, or its module was collected)
    is given back."""

    __slots__ = ("__weakref__", "holds", "thread_id")

    def __init__(self, holds: Holds) -> None:
        self.holds = holds
        self.thread_id = threading.get_ident()

    def __del__(self) -> None:
        try:
            cache.give_back(len(self.holds))
        except Exception:  # at interpreter shutdown, with the modules half torn down
            pass


_ALL_THREAD_HOLDS: weakref.WeakSet[ThreadHolds] = weakref.WeakSet()  # every thread's holds on every gate


def all_thread_holds() -> list[ThreadHolds]:
    """A snapshot of every thread's holds on every gate (another thread's first forward may add one
    while it is taken: then it is taken again)."""
    while True:
        with contextlib.suppress(RuntimeError):  # "Set changed size during iteration"
            return list(_ALL_THREAD_HOLDS)


def _forget_every_hold() -> None:
    """Every gate forgets its holds on every thread, giving nothing back (the counter was reset)."""
    for thread_holds in all_thread_holds():
        thread_holds.holds.clear()


cache.on_reset(_forget_every_hold)


# --- which holds have ended ------------------------------------------------------------------------
def _stack(start: FrameType | None) -> Iterator[FrameType]:
    """``start`` and every frame below it on this thread."""
    frame = start
    while frame is not None:
        yield frame
        frame = frame.f_back


def _on_stack(wanted: FrameType, start: FrameType) -> bool:
    """Whether ``wanted`` is ``start`` or a frame below it on this thread."""
    frame: FrameType | None = start
    while frame is not None:
        if frame is wanted:
            return True
        frame = frame.f_back
    return False


def _forget_frameless(holds: Holds) -> int:
    """Forget, innermost first, the holds taken without a frame (in a compiled trace), without giving
    them back; returns how many."""
    forgotten = 0
    try:
        while holds and holds[-1] is None:
            holds.pop()
            forgotten += 1
    except IndexError:  # reset() on another thread emptied them in between (Python 3.9 switches anywhere)
        pass
    return forgotten


def _forget_ended(holds: Holds, stack: set[FrameType]) -> int:
    """Forget, innermost first, the holds whose frames are not in ``stack`` (a hold without a frame
    among them), without giving them back; returns how many."""
    forgotten = 0
    try:
        while holds and holds[-1] not in stack:
            holds.pop()
            forgotten += 1
    except IndexError:  # reset() on another thread emptied them in between (Python 3.9 switches anywhere)
        pass
    return forgotten


def _give_back_at_reentry(holds: Holds, caller: FrameType | None) -> None:
    """Give back this thread's holds on a gate whose calls have ended, as the gate's pre-hook is
    entered again (``caller``: the frame calling it; None in a compiled trace).

    A module calling itself: the innermost hold's frame is a few frames below the caller, whatever
    the depth, and nothing is given back. A hold a ``BaseException`` left: its frame is not on the
    stack, which is then read once, and every ended hold is given back. In a compiled trace only
    holds without a frame are given back: nothing else can be read there.
    """
    if caller is None:
        cache.give_back(_forget_frameless(holds))
        return
    innermost = holds[-1] if holds else None  # reset() on another thread may have just emptied them
    if innermost is not None and _on_stack(innermost, caller):
        return
    ended = _forget_ended(holds, set(_stack(caller)))
    cache.give_back(ended)


def give_back_ended() -> int:
    """Give back this thread's holds, on every gate, whose calls have ended (left by a
    ``BaseException``, or taken in a compiled trace); returns how many. What the safety nets release as
    their own (a forward still running around the caller keeps its hold)."""
    stack = set(_stack(_frame(1)))
    me = threading.get_ident()
    released = 0
    for thread_holds in all_thread_holds():
        if thread_holds.thread_id == me:
            released += _forget_ended(thread_holds.holds, stack)
    cache.give_back(released)
    return released


# --- the gate and its two hooks ----------------------------------------------------------------------
class Gate(threading.local):
    """What one module's two hooks share: on each thread, that thread's holds on the module."""

    def __init__(self) -> None:  # runs once in every thread that uses the gate, at its first use
        self.holds: Holds = []
        self.thread_holds = ThreadHolds(self.holds)
        _ALL_THREAD_HOLDS.add(self.thread_holds)

    def __deepcopy__(self, memo: dict[int, Any]) -> Gate:
        return Gate()  # a copied module gets a fresh gate: holds belong to live calls

    @staticmethod
    def of(module: torch.nn.Module) -> Gate | None:
        """The gate on ``module``, if it has one."""
        enter = enter_hook(module)
        return None if enter is None else enter.gate


class _Hook:
    """One of a gate's two hooks. It pickles (with pickle, cloudpickle or dill) as the function it
    replaced, by name, so a pickled module loads wherever the original did, with the package or
    without it, and holds a plain pair there (which the patch turns into a gate at its first forward)."""

    __slots__ = ("gate", "replaced")

    def __init__(self, gate: Gate, replaced: str) -> None:
        self.gate = gate
        self.replaced = replaced  # "module:qualified name" of the function this hook replaced

    def __reduce__(self) -> tuple[Any, ...]:
        return _ByName(self.replaced).__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Hook:
        return type(self)(copy.deepcopy(self.gate, memo), self.replaced)

    def __repr__(self) -> str:
        return f"<bnb_gc_fix {type(self).__name__} in the place of {self.replaced}>"


class _ByName:
    """Pickles as ``pkgutil.resolve_name(name)``: the object of that name where it is loaded."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (pkgutil.resolve_name, (self.name,))


class _KeyTakenOut:
    """Pickles as ``always_called.pop(key, None)``: loading it takes ``key`` out of that dictionary
    (which pickle loads once, however many objects refer to it)."""

    __slots__ = ("always_called", "key")

    def __init__(self, always_called: dict[int, bool], key: int) -> None:
        self.always_called = always_called
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self.always_called).pop, (self.always_called, self.key, None))


class EnterHook(_Hook):
    """The gate's forward pre-hook: take one hold on this thread and switch the cache on."""

    __slots__ = ()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        holds = self.gate.holds
        caller = None if _compiling() else _frame(1)
        if holds:  # a re-entry: a self-call, or a hold a BaseException left
            _give_back_at_reentry(holds, caller)
        P._cache_enabled += 1  # the counter first: a Ctrl-C in between can leave one, never take one
        holds.append(caller)


class LeaveHook(_Hook):
    """The gate's always-called forward hook: give back one hold, if this thread has one here.

    Where the disable hooks it replaced were plain, a module pickled with it loads them plain again:
    the pickle loads this hook as the function it replaced and takes its key out of torch's
    always-called dictionary of the module (``plain_key``), which stays torch's own object."""

    __slots__ = ("always_called", "plain_key")

    def __init__(self, gate: Gate, replaced: str) -> None:
        super().__init__(gate, replaced)
        self.always_called: dict[int, bool] | None = None  # the module's, once the hook is placed
        self.plain_key: int | None = None  # this hook's key there, where the pair it replaced was plain

    def __reduce__(self) -> tuple[Any, ...]:
        if self.plain_key is None or self.always_called is None:
            return super().__reduce__()
        loaded = (_ByName(self.replaced), _KeyTakenOut(self.always_called, self.plain_key))
        # Unpickles as (resolve_name(replaced), always_called.pop(key, None))[0]: the function, with the
        # key taken out on the way, and nothing of this package needed to load it.
        return (operator.getitem, (loaded, 0))

    def __deepcopy__(self, memo: dict[int, Any]) -> LeaveHook:
        copied = LeaveHook(copy.deepcopy(self.gate, memo), self.replaced)
        copied.always_called = copy.deepcopy(self.always_called, memo)  # the copied module's
        copied.plain_key = self.plain_key
        return copied

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            self.gate.holds.pop()
        except IndexError:  # no hold on this thread here (or reset() forgot it just now)
            return
        # cache.give_back(1) written out: a call costs time, and a run of bytecodes with no call in it
        # is never cut by a switch to another thread (Python 3.10+), as in torch's own P.cached().
        remaining = P._cache_enabled - 1
        if remaining > 0:
            P._cache_enabled = remaining
        else:
            P._cache_enabled = 0
            P._cache = {}


def enter_hook(module: torch.nn.Module) -> EnterHook | None:
    """The pre-hook of the gate on ``module``, if it has one."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, EnterHook):
            return hook
    return None


def new_hooks(enable_replaced: str, disable_replaced: str) -> tuple[EnterHook, LeaveHook]:
    """A fresh gate's two hooks, standing in for the functions named (``"module:name"``)."""
    gate = Gate()
    return EnterHook(gate, enable_replaced), LeaveHook(gate, disable_replaced)
