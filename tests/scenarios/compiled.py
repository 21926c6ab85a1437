"""torch.compile'd programs over 4-bit quantized modules; prints one JSON summary line.

    python tests/scenarios/compiled.py --trigger interrupt|selfcall|threads|loop [--backend eager]

Triggers (each the hostile case that once crashed the fix's hooks' self-healing inside Dynamo):

* ``interrupt``: a compiled model whose quantized module raises ``KeyboardInterrupt`` in one step;
  the training loop catches it and goes on;
* ``error``: the same with a ``RuntimeError`` (an ``Exception``: always-called hooks run);
* ``selfcall``: a compiled weight-shared block that calls itself inside its forward, for a
  fixed depth;
* ``threads``: a compiled model served from two threads, one after the other (two threads recompiling
  one frame at once race inside Dynamo itself, the control too), with a graph break (``.tolist()``)
  inside the quantized module;
* ``loop``: an ordinary compiled training loop (no interrupt), counting the graphs compiled.

The summary holds the counter after each step, the tickets of the fix's switch-ons left on the thread
after each step (``bnb_gc_fix.ledger``: ``COMPILED`` for one made inside a trace), the outputs (to compare
fix and control), the number of graphs Dynamo compiled (a counting backend around the chosen one) and of
its graph breaks.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

import torch
import torch.nn.utils.parametrize as P
from torch import nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quantized import quantize

TRIGGERS = ("interrupt", "error", "selfcall", "threads", "loop")
RAISES: dict[str, type[BaseException]] = {"interrupt": KeyboardInterrupt, "error": RuntimeError}


class Block(nn.Module):
    """A quantized block: ``x -> tanh(trainable(x) @ w0.T)``; optionally self-calling or breaking."""

    def __init__(self, width: int, depth: int = 0, graph_break: bool = False) -> None:
        super().__init__()
        self.names = ["w0"]
        self.w0 = nn.Parameter(torch.randn(width, width) * 0.1)
        self.trainable = nn.Linear(width, width)
        self.depth = depth
        self.graph_break = graph_break
        self.interrupt: type[BaseException] | None = None

    def forward(self, x: Any, level: int = 0) -> Any:
        x = torch.tanh(self.trainable(x) @ self.w0.t())
        if self.graph_break:
            # Data-dependent routing, as MoE code does: a graph break inside the quantized module.
            top = int(x.abs().sum(-1).argmax().tolist())
            x = x + x[top] * 0.01
        if self.interrupt is not None:
            raise self.interrupt("raised inside the quantized module's forward")
        if level < self.depth:
            x = self(x, level + 1)  # a weight-shared block applied again: a nested call of itself
        return x


class Model(nn.Module):
    def __init__(self, width: int, layers: int, depth: int = 0, graph_break: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, depth, graph_break) for _ in range(layers))

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return x


def counting(backend: str, counts: list[int]) -> Any:
    """A backend that counts the graphs compiled, then hands them to ``backend``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compiler(gm: Any, example_inputs: Any) -> Any:
        counts[0] += 1
        return inner(gm, example_inputs)

    return compiler


def left() -> list[int]:
    """The tickets of the fix's switch-ons left on this thread (none without the fix)."""
    fix = sys.modules.get("bnb_gc_fix.ledger")
    return [] if fix is None else sorted(fix.local.switch_ons.values())


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def run(trigger: str, backend: str, steps: int) -> dict[str, Any]:
    """One trigger on a fresh model; returns its summary."""
    torch.manual_seed(0)
    width = 16
    model = Model(width, layers=2, depth=2 if trigger == "selfcall" else 0, graph_break=trigger == "threads")
    for block in model.blocks:
        quantize(block)  # type: ignore[arg-type]
    counts = [0]
    compiled = torch.compile(model, backend=counting(backend, counts))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    x = torch.randn(4, width)
    counters: list[int] = []
    tickets: list[list[int]] = []
    outputs: list[float] = []
    errors: list[str] = []
    interrupted = 0
    if trigger == "threads":
        with torch.no_grad():  # compiled once on one thread, as a server warms up
            compiled(x)
    for step in range(steps):
        if trigger == "threads":
            results: dict[int, float] = {}

            def serve(i: int, results: dict[int, float] = results) -> None:
                try:
                    with torch.no_grad():
                        results[i] = float(compiled(x + i).sum())
                except BaseException as error:  # reported, not hidden
                    errors.append(f"{type(error).__name__}: {error}"[:300])

            for i in range(2):
                thread = threading.Thread(target=serve, args=(i,))
                thread.start()
                thread.join()
            outputs.append(round(sum(results.values()), 4))
        else:
            if step == 1:
                model.blocks[1].interrupt = RAISES.get(trigger)
            try:
                loss = compiled(x).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                outputs.append(round(float(loss), 6))
            except (KeyboardInterrupt, RuntimeError):
                interrupted += 1
            finally:
                model.blocks[1].interrupt = None
        counters.append(int(P._cache_enabled))
        tickets.append(left())
    summary: dict[str, Any] = {
        "trigger": trigger,
        "backend": backend,
        "counters": counters,
        "left": tickets,
        "graph_breaks": graph_breaks(),
        "outputs": outputs,
        "graphs": counts[0],
        "interrupted": interrupted,
        "errors": errors,
        "cache_entries": len(P._cache),
    }
    if "bnb_gc_fix" in sys.modules:
        summary["state"] = sys.modules["bnb_gc_fix"].status().state
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trigger", required=True, help=f"comma-separated, of {', '.join(TRIGGERS)}")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--import-fix", action="store_true")
    args = parser.parse_args()
    if args.import_fix:
        import bnb_gc_fix  # noqa: F401

    for trigger in args.trigger.split(","):
        assert trigger in TRIGGERS, trigger
        print(json.dumps({"summary": run(trigger, args.backend, args.steps)}), flush=True)
        # The next trigger starts clean in both runs (the control's interrupt leaves the counter up).
        P._cache_enabled = 0
        P._cache = {}
        torch._dynamo.reset()  # and compiles afresh, so graph counts are per trigger
        torch._dynamo.utils.counters.clear()


if __name__ == "__main__":
    main()
