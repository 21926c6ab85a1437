"""Hot-path benchmark: what a forward of a MoE experts module (two parameters quantized by
``replace_parameter_4bit``) costs with the gate, against bitsandbytes 0.50's own always-called pairs on
the same module, the limit for a hook-based fix; a second 0.50 module is the noise floor, bitsandbytes
0.49's plain pairs a reference. Four cases: the hook bodies called directly, the hooks through torch's
module call, a real 4-bit forward on one thread, the same module served from 8 threads (benchmarks/
README.md, "Hot path"; self-calls: ``nesting.py``). Runs with ``BNB_GC_FIX=0``: every configuration is
built by hand.

    python benchmarks/hotpath.py            # writes results/hotpath.json, .md
    python benchmarks/hotpath.py --quick    # 5 rounds of fewer calls (smoke run, results/tmp/)
"""

from __future__ import annotations

import os

os.environ["BNB_GC_FIX"] = "0"  # before bitsandbytes is imported: configurations are built by hand

import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import _common as common
import _harness as harness
from _harness import Timed, loop

BASELINE = "bnb 0.50 pairs"
GATE = "gate (bnb-gc-fix)"
FLOOR = "bnb 0.50 pairs, a second module (noise floor)"
PLAIN = "bnb 0.49 plain pairs (reference)"
#: Each configuration's hooks (``common.quantized``); timed in this order, reversed every other round.
HOOKS = {BASELINE: common.PAIRS_050, GATE: common.GATED, FLOOR: common.PAIRS_050, PLAIN: common.PAIRS_049}
GOAL = 1.00  # no slower than bitsandbytes 0.50's own pairs
NAMES = ("gate_up_proj", "down_proj")  # transformers 5's fused experts
EXPERTS, HIDDEN, INTERMEDIATE, TOKENS = 8, 64, 64, 8


def experts_module(hooks: str) -> Any:
    """A MoE experts module, transformers 5's fused layout (``gate_up_proj`` [experts, 2 x intermediate,
    hidden], ``down_proj`` [experts, hidden, intermediate]), both quantized by ``replace_parameter_4bit``
    (nf4) with ``hooks``; every token goes through every expert (dense), so the forward uses both."""
    import torch

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.05
            down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.05
            self.gate_up_proj = torch.nn.Parameter(gate_up)
            self.down_proj = torch.nn.Parameter(down)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = torch.einsum("th,eoh->eto", x, self.gate_up_proj).chunk(2, dim=-1)
            return torch.einsum("eti,ehi->th", torch.nn.functional.silu(gate) * up, self.down_proj)

    return common.quantized(Experts(), hooks, NAMES)


def experts_modules() -> dict[str, Any]:
    return {name: experts_module(hooks) for name, hooks in HOOKS.items()}


def _case(result: dict[str, Any]) -> dict[str, Any]:
    """Add the gate's reading against the baseline, with the floor's spread and the goal."""
    by_round = result["ns_per_call_by_round"]
    comparison = harness.compare(by_round[GATE], by_round[BASELINE], floor=by_round[FLOOR], goal=GOAL)
    result["gate_over_baseline"] = comparison.record()
    return result


def _hook_bodies(module: Any) -> Callable[[], None]:
    """One forward's hooks of ``module``, called as torch calls them (pre-hooks, then forward hooks, each
    in order), without the module call: 0.50's two enable and two disable hooks, or the gate's two."""
    pre_hooks = tuple(module._forward_pre_hooks.values())
    forward_hooks = tuple(module._forward_hooks.values())
    args = (None,)
    output = None

    def call() -> None:
        for hook in pre_hooks:
            hook(module, args)
        for hook in forward_hooks:
            hook(module, args, output)

    return call


def hook_bodies(calls: int, rounds: int) -> dict[str, Any]:
    """Case a: the hook bodies of the experts module, called directly."""
    modules = experts_modules()
    configs = {name: loop(_hook_bodies(module)) for name, module in modules.items()}
    result = harness.blocks(configs, calls, rounds, BASELINE)
    result["hooks_per_forward"] = {
        name: [len(module._forward_pre_hooks), len(module._forward_hooks)] for name, module in modules.items()
    }
    return _case(result)


def hooks_through_call(calls: int, rounds: int) -> dict[str, Any]:
    """Case a2: the experts module's hooks through torch's module call, its forward replaced by one that
    returns its input (torch's dispatch of the hooks, always-called ones included, is the work)."""
    import torch

    modules = experts_modules()
    for module in modules.values():
        module.forward = _passthrough
    x = torch.zeros(1)
    configs = {name: loop(partial(module, x)) for name, module in modules.items()}
    return _case(harness.blocks(configs, calls, rounds, BASELINE))


def _passthrough(x: Any) -> Any:
    return x


def forward_one_thread(calls: int, rounds: int) -> dict[str, Any]:
    """Case b: a real no-grad 4-bit forward of the experts module (both parameters dequantized), one
    thread; dequantizations per forward counted for each configuration."""
    import torch

    modules = experts_modules()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        common.same_outputs(modules, x)
        counted = {name: common.dequantizations(model, partial(model, x)) for name, model in modules.items()}
        configs = {name: loop(partial(module, x)) for name, module in modules.items()}
        result = harness.blocks(configs, calls, rounds, BASELINE)
    result["dequantizations_per_forward"] = counted
    return _case(result)


class _Pool:
    """``threads`` threads that stay up for the whole case (a server's pool): each block, every one runs
    ``n`` no-grad forwards of ``module``; the block's time is the wall time from the start to the last
    one done."""

    def __init__(self, module: Any, x: Any, threads: int) -> None:
        self.module, self.x, self.n = module, x, 0
        self.start = threading.Barrier(threads + 1)
        self.done = threading.Barrier(threads + 1)
        self.stopping = False
        self.threads = [threading.Thread(target=self._serve, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _serve(self) -> None:
        import torch

        while True:
            self.start.wait()
            if self.stopping:
                return
            with torch.no_grad():
                for _ in range(self.n):
                    self.module(self.x)
            self.done.wait()

    def timed(self, n: int) -> int:
        self.n = n
        started = time.perf_counter_ns()
        self.start.wait()
        self.done.wait()
        return time.perf_counter_ns() - started

    def close(self) -> None:
        self.stopping = True
        self.start.wait()
        for thread in self.threads:
            thread.join()


def served(threads: int, forwards: int, rounds: int) -> dict[str, Any]:
    """Case c: the experts module served from ``threads`` threads at once."""
    import torch

    modules = experts_modules()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    common.same_outputs(modules, x)
    pools = {name: _Pool(module, x, threads) for name, module in modules.items()}
    try:
        configs: dict[str, Timed] = {name: pool.timed for name, pool in pools.items()}
        result = harness.blocks(configs, forwards, rounds, BASELINE)
    finally:
        for pool in pools.values():
            pool.close()
    result["threads"] = threads
    result["note"] = (
        "wall time of a block in which every thread runs calls_per_block forwards, per calls_per_block "
        "(so per forward of one thread)"
    )
    return _case(result)


TITLES = {
    "hook_bodies": "a. Hook bodies called directly (0.50: two enable, two disable hooks; gate: enable_code, disable_code)",
    "hooks_through_call": "a2. The same hooks through torch's module call, forward returns its input",
    "forward_1_thread": "b. A real 4-bit forward of the experts module, 1 thread",
    "forward_8_threads": "c. The same module served from 8 threads",
}


def _case_markdown(title: str, case: dict[str, Any]) -> list[str]:
    rows = []
    for name, value in case["median_ns_per_call"].items():
        ratio = "baseline" if name == BASELINE else harness.Spread(**case["ratio_to_baseline"][name]).text()
        rows.append([name, f"{value / 1e3:.3f} µs", ratio])
    header = ["configuration", "median per call", "ratio to 0.50 pairs: median of rounds (IQR)"]
    lines = [f"**{title}**, {case['rounds']} rounds of {case['calls_per_block']:,} calls", ""]
    lines += harness.table(header, rows)
    comparison = case["gate_over_baseline"]
    met = "met" if comparison["met"] else "NOT met"
    ratio = harness.Spread(**comparison["ratio"]).text()
    floor = harness.Spread(**comparison["noise_floor"]).text()
    lines += [
        "",
        f"Gate / 0.50 pairs {ratio}; noise floor {floor}; result: **{comparison['result']}**; "
        f"goal {comparison['goal']}: {met}.",
    ]
    if "threads" in case:
        lines += ["", f"A call: {case['threads']} threads each running one forward, all at once (wall time)."]
    if "dequantizations_per_forward" in case:
        counted = ", ".join(f"{name} {count}" for name, count in case["dequantizations_per_forward"].items())
        lines += ["", f"Dequantizations per forward: {counted}."]
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for key, title in TITLES.items():
        lines += _case_markdown(title, result[key])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--quick", action="store_true", help="5 rounds of fewer calls")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    rounds = 5 if args.quick else args.rounds
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # bitsandbytes' CPU backend, every call
    torch.set_num_threads(1)
    common.unpatched_bitsandbytes()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "hotpath",
        "machine": harness.machine(),
        "method": (
            "same process, configurations timed in blocks of calls, block order alternating every "
            "round, garbage collector off during blocks, wall time; ratio = median over rounds of block "
            "time / the 0.50 pairs' block time of the same round, with the interquartile range; noise "
            "floor: a second 0.50-pairs module timed in the same rounds"
        ),
        "shape": {
            "parameters": {
                "gate_up_proj": [EXPERTS, 2 * INTERMEDIATE, HIDDEN],
                "down_proj": [EXPERTS, HIDDEN, INTERMEDIATE],
            },
            "tokens": TOKENS,
            "quant_type": "nf4",
        },
        "configurations": HOOKS,
        "goal": f"gate / 0.50 pairs <= {GOAL:.2f}",
        "hook_bodies": hook_bodies(10000 // scale, rounds),
        "hooks_through_call": hooks_through_call(2000 // scale, rounds),
        "forward_1_thread": forward_one_thread(200 // scale, rounds),
        "forward_8_threads": served(8, 40 // scale, rounds),
    }
    result["wall_s"] = time.perf_counter() - started
    output = harness.output_path("hotpath.json", args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
