"""The gate's invariant over random programs (Hypothesis), in one fresh interpreter.

    python tests/scenarios/gate_property.py [--examples N]

A program is a tree of calls of a few 4-bit quantized modules: nested and sibling calls, a
module calling itself (directly or through others), non-reentrant checkpointed regions whose
backward recompute stops early, ``Exception`` and ``BaseException`` raised at random points and
caught at random levels, and sub-programs run on a second thread. An oracle tracks what the
counter must be: one hold per module call live on a stack, plus the holds that a
``BaseException`` left behind on a thread that is still running and that no forward of that module
on that thread has healed yet (a thread's holds end with it). After every
caught exit: the counter equals the oracle, it is never negative, and the cache is empty at
zero; at the end, one forward of every module heals what is left, and the counter is 0.

Exits 0 when the property holds; otherwise Hypothesis prints the smallest falsifying program and
the exit status is 1 (the control, with the fix switched off, must fail).
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Union

import torch
import torch.nn.utils.parametrize as P
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quantized import quantize

MODULES = 3
WIDTH = 8


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
class Raise:
    base: bool  # Interrupt (a BaseException) or Failure (an Exception)


@dataclass(frozen=True)
class Checkpointed:
    module: int  # forward under non-reentrant checkpointing, then backward: the recompute stops early


@dataclass(frozen=True)
class OnThread:
    body: tuple[Step, ...]  # run as a program of its own on a second thread, joined at once


Step = Union[Call, Raise, Checkpointed, OnThread]


@dataclass
class Oracle:
    """What the counter must be: live calls on the stacks plus unhealed holds left by BaseExceptions,
    by (thread, module)."""

    live: int = 0
    stale: dict[tuple[int, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    failures: list[str] = field(default_factory=list)

    def expected(self) -> int:
        return self.live + sum(self.stale.values())

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


class Node(nn.Module):
    """A quantized module whose forward runs the program step it is given."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.names = ["w0"]
        self.w0 = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.1)

    def forward(self, x: Any, body: tuple[Step, ...] = ()) -> Any:
        y = torch.tanh(x @ self.w0.t())
        run(body, y.detach(), oracle=ORACLE)
        return y


ORACLE = Oracle()
NODES: list[Node] = []


def call(step: Call, x: Any, oracle: Oracle) -> None:
    module = NODES[step.module]
    key = (threading.get_ident(), step.module)
    with oracle.lock:
        oracle.stale.pop(key, None)  # its pre-hook heals what BaseExceptions left on this thread
        oracle.live += 1
    try:
        module(x, step.body)
    except Failure:
        with oracle.lock:
            oracle.live -= 1  # the always-called hook gave it back
        if step.catch is None:
            raise
        oracle.check("caught a Failure")
        return
    except Interrupt:
        with oracle.lock:
            oracle.live -= 1
            oracle.stale[key] = oracle.stale.get(key, 0) + 1  # no hook ran
        if step.catch != "any":
            raise
        oracle.check("caught an Interrupt")
        return
    with oracle.lock:
        oracle.live -= 1


def checkpointed(step: Checkpointed, x: Any, oracle: Oracle) -> None:
    module = NODES[step.module]
    with oracle.lock:
        oracle.stale.pop((threading.get_ident(), step.module), None)
    leaf = x.detach().requires_grad_(True)
    with torch.enable_grad():
        out = checkpoint(module, leaf, use_reentrant=False)
        out.sum().backward()  # the recompute's forward is stopped early by an exception inside it
    oracle.check("after a checkpointed forward and its backward")


def on_thread(step: OnThread, x: Any, oracle: Oracle) -> None:
    def body() -> None:
        try:
            run(step.body, x, oracle)
        except (Failure, Interrupt):
            oracle.check("caught on the thread")

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    with oracle.lock:  # what the thread left behind ended with it
        oracle.stale = {key: held for key, held in oracle.stale.items() if key[0] != thread.ident}
    oracle.check("after joining the thread")


def run(body: tuple[Step, ...], x: Any, oracle: Oracle) -> None:
    for step in body:
        if isinstance(step, Raise):
            raise Interrupt() if step.base else Failure()
        if isinstance(step, Call):
            call(step, x, oracle)
        elif isinstance(step, Checkpointed):
            checkpointed(step, x, oracle)
        else:
            on_thread(step, x, oracle)


def programs(depth: int = 3) -> st.SearchStrategy[tuple[Step, ...]]:
    module = st.integers(0, MODULES - 1)
    leaf: st.SearchStrategy[Step] = st.one_of(
        st.builds(Raise, base=st.booleans()),
        st.builds(Checkpointed, module=module),
        st.builds(Call, module=module, body=st.just(()), catch=st.sampled_from([None, "exception", "any"])),
    )

    def extend(inner: st.SearchStrategy[Step]) -> st.SearchStrategy[Step]:
        bodies = st.lists(inner, max_size=3).map(tuple)
        return st.one_of(
            st.builds(Call, module=module, body=bodies, catch=st.sampled_from([None, "exception", "any"])),
            st.builds(OnThread, body=bodies),
        )

    return st.lists(st.recursive(leaf, extend, max_leaves=8), min_size=1, max_size=4).map(tuple)


def check_program(program: tuple[Step, ...]) -> None:
    global ORACLE
    P._cache_enabled = 0
    P._cache = {}
    if "bnb_gc_fix" in sys.modules:
        sys.modules["bnb_gc_fix"].reset()  # forget holds an earlier example left
    ORACLE = oracle = Oracle()
    x = torch.randn(2, WIDTH)
    try:
        run(program, x, oracle)
    except (Failure, Interrupt):
        oracle.check("caught at the top")
    for index, module in enumerate(NODES):  # one forward of each heals what is left
        oracle.stale.pop((threading.get_ident(), index), None)
        module(x)
    oracle.check("at the end")
    assert not oracle.failures, "\n".join(oracle.failures)
    assert int(P._cache_enabled) == 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    NODES.extend(quantize(Node(i)) for i in range(MODULES))  # type: ignore[misc]

    @settings(
        max_examples=args.examples,
        deadline=None,
        derandomize=True,  # the same programs on every run: a failure is reproducible, never flaky
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(programs())
    def prop(program: tuple[Step, ...]) -> None:
        check_program(program)

    try:
        prop()
    except AssertionError as error:
        print(f"PROPERTY FAILED: {error}")
        return 1
    print(f"PROPERTY HELD over {args.examples} programs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
