"""Nesting benchmark: the gate against bitsandbytes' plain pair when a 4-bit module calls itself to depth
3, 10, 100, 500, and under a wrapped ``Module._call_impl`` (in a child interpreter: the wrapper must be in
place before bnb_gc_fix is imported); CPU time and dequantizations per call (benchmarks/README.md,
"Nesting", and its commands). Goal: gate / control <= 1.05 at every depth.
"""

from __future__ import annotations

import os

os.environ["BNB_GC_FIX"] = "0"  # before bitsandbytes is imported: configurations are built by hand

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import _common as common
import _harness as harness

DEPTHS = (3, 10, 100, 500)
QUICK_DEPTHS = (3, 10)
WRAPPED_DEPTH = 3
GOAL = 1.05
CONTROL = "plain pair (bnb 0.49)"
GATE = "gate (bnb-gc-fix)"
FLOOR = "plain pair, a second model (noise floor)"
WIDTH = 64
BATCH = 8


def wrap_call_impl() -> None:
    """Replace ``Module._call_impl`` by a wrapper that calls the original (before bnb_gc_fix's import)."""
    assert "bnb_gc_fix" not in sys.modules, "the wrapper must be in place before bnb_gc_fix is imported"
    import torch

    original = torch.nn.Module._call_impl

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    torch.nn.Module._call_impl = wrapper


def build(gated: bool) -> Any:
    """A 4-bit module whose forward calls itself ``depth`` times, nested; every call uses the weight before
    and after its self-call (the innermost once), so a cache lost inside a nested call shows as more
    dequantizations: 2 x depth + 1 uses of the weight, one dequantization while the cache holds."""
    import torch

    class Nested(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

        def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
            x = torch.tanh(x @ self.weight.t())
            if depth == 0:
                return x
            return torch.tanh(self(x, depth - 1) @ self.weight.t())

    return common.quantized(Nested(), gated)


def dequantizations(module: Any, call: Callable[[], Any]) -> int:
    """How often one ``call`` dequantizes ``module``'s weight (calls of its parametrization's forward)."""
    parametrization = module.parametrizations.weight[0]
    original = parametrization.forward
    count = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        return original(*args, **kwargs)

    parametrization.forward = counted
    try:
        call()
    finally:
        del parametrization.forward
    return count


def calls_per_block(depth: int) -> int:
    """Enough calls for a block of about 400 module calls (so a block takes milliseconds at every depth)."""
    return max(2, 400 // (depth + 1))


def depth_case(depth: int, rounds: int) -> dict[str, Any]:
    """Control, gate and noise floor at one depth: CPU time per call and dequantizations per call."""
    import warnings

    import torch
    import torch.nn.utils.parametrize as P

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20 * depth + 1000))
    warnings.filterwarnings("ignore", category=FutureWarning)  # bitsandbytes' CPU backend, every call
    common.unpatched_bitsandbytes()
    models = {CONTROL: build(gated=False), GATE: build(gated=True), FLOOR: build(gated=False)}
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        calls = {name: partial(model, x, depth) for name, model in models.items()}
        common.same_outputs(models, x, depth)
        counted = {name: dequantizations(models[name], call) for name, call in calls.items()}
        configs = {name: harness.loop(call, clock=time.process_time_ns) for name, call in calls.items()}
        result = harness.blocks(configs, calls_per_block(depth), rounds, baseline=CONTROL)
    assert (P._cache_enabled, len(P._cache)) == (0, 0), "the cache was left on"
    by_round = result["ns_per_call_by_round"]
    comparison = harness.compare(by_round[GATE], by_round[CONTROL], floor=by_round[FLOOR], goal=GOAL)
    result["depth"] = depth
    result["clock"] = "time.process_time_ns (CPU time of the process)"
    result["dequantizations_per_call"] = counted
    result["dequantizations_equal"] = counted[GATE] == counted[CONTROL]
    result["gate_over_control"] = comparison.record()
    return result


def wrapped_case(rounds: int) -> dict[str, Any]:
    """The depth-3 case in a child interpreter whose ``Module._call_impl`` is wrapped before the import."""
    command = [sys.executable, str(Path(__file__).resolve()), "--wrapped-child", "--rounds", str(rounds)]
    child = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=harness.ROOT, check=True)
    messages = [harness.message_of(line) for line in child.stdout.splitlines()]
    found = [message for message in messages if message is not None]
    result: dict[str, Any] = found[-1]
    result["call_impl"] = "wrapped before bnb_gc_fix was imported: def wrapper(*args, **kwargs)"
    return result


def wrapped_child(rounds: int) -> None:
    wrap_call_impl()
    import torch

    torch.set_num_threads(1)
    harness.emit(depth_case(WRAPPED_DEPTH, rounds))


def row(title: str, case: dict[str, Any]) -> list[str]:
    comparison = case["gate_over_control"]
    ratio = harness.Spread(**comparison["ratio"])
    floor = harness.Spread(**comparison["noise_floor"])
    median = case["median_ns_per_call"]
    counted = case["dequantizations_per_call"]
    met = "met" if comparison["met"] else "not met"
    return [
        f"{title} ({case['rounds']} rounds x {case['calls_per_block']} calls)",
        f"{median[CONTROL] / 1e3:.1f} µs",
        f"{median[GATE] / 1e3:.1f} µs",
        ratio.text(),
        floor.text(),
        f"**{comparison['result']}**",
        f"{counted[CONTROL]} / {counted[GATE]}",
        f"{comparison['goal']}: {met}",
    ]


def markdown(result: dict[str, Any]) -> str:
    header = [
        "case",
        "control (plain pair), CPU per call",
        "gate",
        "ratio gate / control",
        "noise floor",
        "result",
        "dequantizations per call, control / gate",
        "goal",
    ]
    rows = [row(f"self-calls to depth {case['depth']}", case) for case in result["depths"]]
    if "wrapped_call_impl" in result:
        case = result["wrapped_call_impl"]
        rows.append(row(f"wrapped `Module._call_impl`, depth {case['depth']}", case))
    lines = [
        "**A 4-bit module calling itself**: bitsandbytes' plain pair (control) vs the gate, CPU time, "
        "median of per-round ratios (interquartile range); noise floor: a second plain model.",
        "",
        *harness.table(header, rows),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=51)
    parser.add_argument("--depths", type=int, nargs="+", help=f"default {' '.join(map(str, DEPTHS))}")
    parser.add_argument("--quick", action="store_true", help="5 rounds, depths 3 and 10")
    parser.add_argument("--no-wrapped", action="store_true", help="skip the wrapped _call_impl case")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--wrapped-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else args.rounds
    if args.wrapped_child:
        wrapped_child(rounds)
        return None
    import torch

    torch.set_num_threads(1)
    depths = args.depths or (QUICK_DEPTHS if args.quick else DEPTHS)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "nesting",
        "machine": harness.machine(),
        "method": (
            "same process, control / gate / noise floor timed in blocks of no-grad calls, order alternating "
            "every round, garbage collector off during blocks; CPU time; ratio = median over rounds of gate "
            "block / control block of the same round, with the interquartile range"
        ),
        "goal": f"gate / control <= {GOAL:.2f} at every depth",
        "depths": [depth_case(depth, rounds) for depth in depths],
    }
    if not args.no_wrapped:
        result["wrapped_call_impl"] = wrapped_case(rounds)
    result["wall_s"] = time.perf_counter() - started
    output = harness.output_path("nesting.json", args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
