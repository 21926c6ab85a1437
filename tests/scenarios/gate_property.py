"""The liveness rule over random programs on two interleaved threads (Hypothesis), in one interpreter.

    python tests/scenarios/gate_property.py [--examples N]

Each of two threads runs a program of top-level steps, each step inside ``bnb_gc_fix.guard()`` (the
safety net around a training step). A step is a tree of calls of a few 4-bit quantized modules: nested
and sibling calls, a module calling itself (directly or through others), non-reentrant checkpointed
regions whose backward recompute stops early, ``P.cached()`` blocks, ``Exception`` and
``BaseException`` raised at random points and caught at random levels, and yields. A yield hands the
turn to the other thread (one thread runs at a time, so every interleaving is the program's own and
the same on every run): a call or a ``P.cached()`` block can stay open on one thread while the other
runs.

An oracle tracks what the counter must be: one hold per call still running and per open ``P.cached()``
block, on either thread, plus the holds a ``BaseException`` left on the thread that is not at the end of
a step (the module's next call on that thread gives them back, and the guard at the end of each step
gives back what is left of its own thread's). After every caught exit, every yield and every step: the
counter is never negative, it equals the oracle, and the cache is empty at zero. At the end the counter
is 0.

Exits 0 when the property holds; otherwise Hypothesis prints the smallest falsifying program and the
exit status is 1 (the control, with the fix switched off, must fail: the guard cannot tell there which
thread a hold left by bitsandbytes' plain pair belongs to while the other thread runs).
"""

from __future__ import annotations

import argparse
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.nn.utils.parametrize as P
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import bnb_gc_fix

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quantized import quantize

MODULES = 3
WIDTH = 8
THREADS = 2


class Interrupt(BaseException):
    """A BaseException of the program's own (as KeyboardInterrupt): torch runs no forward hook."""


class Failure(Exception):  # noqa: N818  (the program's own, as Interrupt)
    """An Exception of the program's own: torch runs always-called forward hooks."""


@dataclass(frozen=True)
class Call:
    module: int
    body: tuple[Step, ...]
    catch: str | None  # None, "exception" (catches Failure only) or "any" (Failure and Interrupt)


@dataclass(frozen=True)
class Cached:
    body: tuple[Step, ...]  # run inside `with P.cached():`


@dataclass(frozen=True)
class Raise:
    base: bool  # Interrupt (a BaseException) or Failure (an Exception)


@dataclass(frozen=True)
class Checkpointed:
    module: int  # forward under non-reentrant checkpointing, then backward: the recompute stops early


@dataclass(frozen=True)
class Yield:
    """Hand the turn to the other thread, and wait for it to come back."""


Step = Union[Call, Cached, Raise, Checkpointed, Yield]


@dataclass
class Oracle:
    """What the counter must be: per thread, the calls running and the open ``P.cached()`` blocks, and
    the holds BaseExceptions left, by module."""

    live: list[int] = field(default_factory=lambda: [0] * THREADS)
    stale: list[dict[int, int]] = field(default_factory=lambda: [{} for _ in range(THREADS)])
    failures: list[str] = field(default_factory=list)

    def expected(self) -> int:
        return sum(self.live) + sum(sum(left.values()) for left in self.stale)

    def check(self, where: str) -> None:
        counter = int(P._cache_enabled)
        problems = []
        if counter < 0:
            problems.append("negative")
        if counter != self.expected():
            problems.append(f"expected {self.expected()} (live {self.live}, stale {self.stale})")
        if counter == 0 and P._cache:
            problems.append(f"{len(P._cache)} cache entries at zero")
        if problems:
            self.failures.append(f"{where}: counter {counter}: {', '.join(problems)}")


class Turns:
    """One thread runs at a time; a yield hands the turn to the other thread while it has work."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.turn = 0
        self.done = [False] * THREADS

    def wait(self, me: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.turn == me)

    def hand_over(self, me: int) -> None:
        other = 1 - me
        if self.done[other]:
            return
        with self.condition:
            self.turn = other
            self.condition.notify_all()
        self.wait(me)

    def finish(self, me: int) -> None:
        with self.condition:
            self.done[me] = True
            self.turn = 1 - me
            self.condition.notify_all()


class Node(nn.Module):
    """A quantized module whose forward runs the program steps it is given."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.names = ["w0"]
        self.w0 = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.1)

    def forward(self, x: Any, run_body: Callable[[], None] | None = None) -> Any:
        y = torch.tanh(x @ self.w0.t())
        if run_body is not None:
            run_body()
        return y


@dataclass
class World:
    oracle: Oracle
    turns: Turns
    nodes: list[Node]


def _enter(world: World, me: int, module: int) -> None:
    """A call of ``module`` on thread ``me`` starts: its pre-hook gives back what BaseExceptions left."""
    world.oracle.stale[me].pop(module, None)


def call(world: World, me: int, step: Call, x: Any) -> None:
    oracle = world.oracle
    _enter(world, me, step.module)
    oracle.live[me] += 1
    try:
        world.nodes[step.module](x, lambda: run(world, me, step.body, x))
    except Failure:
        oracle.live[me] -= 1  # the always-called hook gave it back
        if step.catch is None:
            raise
        oracle.check("caught a Failure")
        return
    except Interrupt:
        oracle.live[me] -= 1
        oracle.stale[me][step.module] = oracle.stale[me].get(step.module, 0) + 1  # no hook ran
        if step.catch != "any":
            raise
        oracle.check("caught an Interrupt")
        return
    oracle.live[me] -= 1


def cached(world: World, me: int, step: Cached, x: Any) -> None:
    with P.cached():
        world.oracle.live[me] += 1
        try:
            run(world, me, step.body, x)
        finally:
            world.oracle.live[me] -= 1  # the block's exit gives its hold back, however it is left


def checkpointed(world: World, me: int, step: Checkpointed, x: Any) -> None:
    _enter(world, me, step.module)
    leaf = x.detach().requires_grad_(True)
    with torch.enable_grad():
        out = checkpoint(world.nodes[step.module], leaf, use_reentrant=False)
        out.sum().backward()  # the recompute's forward is stopped early by an exception inside it
    world.oracle.check("after a checkpointed forward and its backward")


def run(world: World, me: int, body: tuple[Step, ...], x: Any) -> None:
    for step in body:
        if isinstance(step, Raise):
            raise Interrupt() if step.base else Failure()
        if isinstance(step, Yield):
            world.turns.hand_over(me)
            world.oracle.check("back from the other thread")
        elif isinstance(step, Call):
            call(world, me, step, x)
        elif isinstance(step, Cached):
            cached(world, me, step, x)
        else:
            checkpointed(world, me, step, x)


def thread_program(world: World, me: int, steps: tuple[tuple[Step, ...], ...]) -> None:
    """Each top-level step guarded; what a BaseException left on this thread is gone after its guard."""
    x = torch.randn(2, WIDTH)
    world.turns.wait(me)
    try:
        for step in steps:
            try:
                with bnb_gc_fix.guard():
                    run(world, me, step, x)
            except (Failure, Interrupt):
                pass
            world.oracle.stale[me].clear()
            world.oracle.check(f"after a step of thread {me}")
    finally:
        world.turns.finish(me)


def programs() -> st.SearchStrategy[tuple[tuple[Step, ...], ...]]:
    module = st.integers(0, MODULES - 1)
    catch = st.sampled_from([None, "exception", "any"])
    leaf: st.SearchStrategy[Step] = st.one_of(
        st.builds(Raise, base=st.booleans()),
        st.builds(Checkpointed, module=module),
        st.builds(Yield),
        st.builds(Call, module=module, body=st.just(()), catch=catch),
    )

    def extend(inner: st.SearchStrategy[Step]) -> st.SearchStrategy[Step]:
        bodies = st.lists(inner, max_size=3).map(tuple)
        calls = st.builds(Call, module=module, body=bodies, catch=catch)
        return st.one_of(calls, st.builds(Cached, body=bodies))

    step = st.lists(st.recursive(leaf, extend, max_leaves=8), min_size=1, max_size=3).map(tuple)
    return st.lists(step, min_size=1, max_size=3).map(tuple)


def check_programs(nodes: list[Node], first: Any, second: Any) -> None:
    P._cache_enabled = 0
    P._cache = {}
    bnb_gc_fix.reset()  # forget holds an earlier example left
    world = World(oracle=Oracle(), turns=Turns(), nodes=nodes)
    other = threading.Thread(target=thread_program, args=(world, 1, second))
    other.start()
    thread_program(world, 0, first)
    other.join()
    world.oracle.check("at the end")
    assert not world.oracle.failures, "\n".join(world.oracle.failures)
    assert int(P._cache_enabled) == 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    nodes = [quantize(Node(i)) for i in range(MODULES)]  # type: ignore[arg-type]
    warnings.simplefilter("ignore")  # the guard's reports: the oracle checks what they say

    @settings(
        max_examples=args.examples,
        deadline=None,
        derandomize=True,  # the same programs on every run: a failure is reproducible, never flaky
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(programs(), programs())
    def prop(first: Any, second: Any) -> None:
        check_programs(nodes, first, second)

    try:
        prop()
    except Exception as error:  # an AssertionError, or Hypothesis' own report of a flaky one
        print(f"PROPERTY FAILED: {type(error).__name__}: {error}")
        return 1
    print(f"PROPERTY HELD over {args.examples} programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
