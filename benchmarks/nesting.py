"""Nesting benchmark: a 4-bit module with two quantized parameters (the MoE experts shape) calling itself
to depth 3 and 100, with the gate against bitsandbytes 0.50's own always-called pairs on the same module
(the limit for a hook-based fix); a second 0.50 module is the noise floor, bitsandbytes 0.49's plain pairs
a reference. CPU time and dequantizations per call (benchmarks/README.md, "Nesting"). Goal: the gate no
slower than the 0.50 pairs, and dequantizing no more often.

    python benchmarks/nesting.py            # depths 3 and 100: results/nesting.json, .md
    python benchmarks/nesting.py --quick    # 5 rounds (results/tmp/)
"""

from __future__ import annotations

import os

os.environ["BNB_GC_FIX"] = "0"  # before bitsandbytes is imported: configurations are built by hand

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import _common as common
import _harness as harness

DEPTHS = (3, 100)
GOAL = 1.00  # no slower than bitsandbytes 0.50's own pairs
BASELINE = "bnb 0.50 pairs"
GATE = "gate (bnb-gc-fix)"
FLOOR = "bnb 0.50 pairs, a second module (noise floor)"
PLAIN = "bnb 0.49 plain pairs (reference)"
#: Each configuration's hooks (``common.quantized``); timed in this order, reversed every other round.
HOOKS = {BASELINE: common.PAIRS_050, GATE: common.GATED, FLOOR: common.PAIRS_050, PLAIN: common.PAIRS_049}
NAMES = ("first", "second")
WIDTH = 64
BATCH = 8


def build(hooks: str) -> Any:
    """A module with two 64x64 weights quantized by ``replace_parameter_4bit`` (nf4), carrying ``hooks``,
    whose forward calls itself ``depth`` times, nested; every call uses both weights before and after its
    self-call (the innermost once), so a cache lost inside a nested call shows as more dequantizations:
    2 x (2 x depth + 1) uses of the weights, two dequantizations while the cache holds."""
    import torch

    class Nested(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            for name in NAMES:
                weight = torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5
                self.register_parameter(name, torch.nn.Parameter(weight))

        def step(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ self.first.t()) @ self.second.t()

        def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
            x = self.step(x)
            if depth == 0:
                return x
            return self.step(self(x, depth - 1))

    return common.quantized(Nested(), hooks, NAMES)


def calls_per_block(depth: int) -> int:
    """Enough calls for a block of about 400 module calls (so a block takes milliseconds at every depth)."""
    return max(2, 400 // (depth + 1))


def depth_case(depth: int, rounds: int) -> dict[str, Any]:
    """Every configuration at one depth: CPU time per call and dequantizations per call."""
    import torch
    import torch.nn.utils.parametrize as P

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * depth + 1000))
    models = {name: build(hooks) for name, hooks in HOOKS.items()}
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        calls = {name: partial(model, x, depth) for name, model in models.items()}
        common.same_outputs(models, x, depth)
        counted = {name: common.dequantizations(models[name], call) for name, call in calls.items()}
        configs = {name: harness.loop(call, clock=time.process_time_ns) for name, call in calls.items()}
        result = harness.blocks(configs, calls_per_block(depth), rounds, baseline=BASELINE)
    assert (P._cache_enabled, len(P._cache)) == (0, 0), "the cache was left on"
    by_round = result["ns_per_call_by_round"]
    comparison = harness.compare(by_round[GATE], by_round[BASELINE], floor=by_round[FLOOR], goal=GOAL)
    result["depth"] = depth
    result["clock"] = "time.process_time_ns (CPU time of the process)"
    result["dequantizations_per_call"] = counted
    result["gate_dequantizes_no_more"] = counted[GATE] <= counted[BASELINE]
    result["gate_over_baseline"] = comparison.record()
    return result


def row(case: dict[str, Any]) -> list[str]:
    comparison = case["gate_over_baseline"]
    median = case["median_ns_per_call"]
    counted = case["dequantizations_per_call"]
    plain = harness.Spread(**case["ratio_to_baseline"][PLAIN])
    met = "met" if comparison["met"] else "not met"
    return [
        f"depth {case['depth']} ({case['rounds']} rounds x {case['calls_per_block']} calls)",
        f"{median[BASELINE] / 1e3:.1f} µs",
        f"{median[GATE] / 1e3:.1f} µs",
        harness.Spread(**comparison["ratio"]).text(),
        harness.Spread(**comparison["noise_floor"]).text(),
        f"**{comparison['result']}**",
        f"{comparison['goal']}: {met}",
        f"{counted[BASELINE]} / {counted[GATE]} / {counted[PLAIN]}",
        plain.text(),
    ]


def markdown(result: dict[str, Any]) -> str:
    header = [
        "case",
        "0.50 pairs (baseline), CPU per call",
        "gate",
        "ratio gate / 0.50 pairs",
        "noise floor",
        "result",
        "goal",
        "dequantizations per call, 0.50 / gate / 0.49",
        "0.49 plain pairs / 0.50 pairs",
    ]
    lines = [
        "**A 4-bit module with two quantized weights calling itself**: bitsandbytes 0.50's pairs (baseline) "
        "vs the gate, CPU time, median of per-round ratios (interquartile range); noise floor: a second "
        "0.50 module.",
        "",
        *harness.table(header, [row(case) for case in result["depths"]], left=(0, 5, 6)),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--depths", type=int, nargs="+", help=f"default {' '.join(map(str, DEPTHS))}")
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # bitsandbytes' CPU backend, every call
    torch.set_num_threads(1)
    common.unpatched_bitsandbytes()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "nesting",
        "machine": harness.machine(),
        "method": (
            "same process, every configuration timed in blocks of no-grad calls, order alternating every "
            "round, garbage collector off during blocks; CPU time; ratio = median over rounds of block / "
            "the 0.50 pairs' block of the same round, with the interquartile range; noise floor: a second "
            "0.50-pairs module timed in the same rounds"
        ),
        "configurations": HOOKS,
        "goal": f"gate / 0.50 pairs <= {GOAL:.2f} at every depth, and no more dequantizations",
        "depths": [depth_case(depth, rounds) for depth in args.depths or DEPTHS],
    }
    result["wall_s"] = time.perf_counter() - started
    output = harness.output_path("nesting.json", args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
