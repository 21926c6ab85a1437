"""Hot-path benchmark: what one forward costs with the gate instead of bitsandbytes' plain pair, in seven
cases (hooks alone, two parameters, two 4-bit parameters, the hook bodies, 8 threads and 1, self-calls);
each case and its goal: benchmarks/README.md, "Hot path". Runs with ``BNB_GC_FIX=0``: every configuration
is built by hand.

    python benchmarks/hotpath.py            # writes results/hotpath.json
    python benchmarks/hotpath.py --quick    # fewer rounds (smoke run)
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

PLAIN = "plain pair (bnb 0.49)"
GATE = "gate (bnb-gc-fix)"


def _goal(
    result: dict[str, Any], name: str, label: str, goal: float, floor: str | None = None
) -> dict[str, Any]:
    """Add the case's figure (``name``'s ratio), its goal, whether it is met, and how it reads (against the
    noise floor ``floor``, or with none against 1)."""
    by_round = result["ns_per_call_by_round"]
    baseline = by_round[result["baseline"]]
    comparison = harness.compare(
        by_round[name], baseline, floor=by_round[floor] if floor else None, goal=goal
    )
    result["ratio"] = comparison.ratio.median
    result["goal"] = f"{label} <= {goal:.2f}"
    result["met"] = comparison.met
    result["result"] = comparison.verdict
    return result


def _passthrough(parameters: tuple[str, ...]) -> Any:
    """A module with tiny ``parameters`` whose forward returns its input: the hooks are the work."""
    import torch

    class Passthrough(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in parameters:
                self.register_parameter(name, torch.nn.Parameter(torch.zeros(1), requires_grad=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    return Passthrough()


def _registered(register: Callable[..., None], parameters: tuple[str, ...], gated: bool = False) -> Any:
    from bnb_gc_fix import hooks

    module = _passthrough(parameters)
    for name in parameters:
        register(module, name)
    if gated:
        assert hooks.install(module) and len(module._forward_pre_hooks) == 1
    return module


def hooks_alone(calls: int, rounds: int) -> dict[str, Any]:
    """Case 1: no hooks, the plain pair, upstream 0.50's pair and the gate on a passthrough module."""
    import torch

    register_plain = common.unpatched_bitsandbytes()
    register_upstream, _ = common.upstream_hooks()
    modules = {
        "no hooks": _passthrough(("weight",)),
        PLAIN: _registered(register_plain, ("weight",)),
        "upstream 0.50 pair": _registered(register_upstream, ("weight",)),
        GATE: _registered(register_plain, ("weight",), gated=True),
    }
    x = torch.zeros(1)
    result = harness.blocks(
        {name: loop(partial(module, x)) for name, module in modules.items()}, calls, rounds, PLAIN
    )
    median = result["median_ns_per_call"]
    overhead = {name: value - median["no hooks"] for name, value in median.items() if name != "no hooks"}
    result["hook_overhead_ns"] = overhead
    result["hook_overhead_ratio_gate_over_plain"] = overhead[GATE] / overhead[PLAIN]
    return _goal(result, GATE, "gate / plain pair", 1.10)


def two_pairs_alone(calls: int, rounds: int) -> dict[str, Any]:
    """Case 1b: two parameters, two plain pairs (what bnb registers) against one gate."""
    import torch

    register_plain = common.unpatched_bitsandbytes()
    plain = _registered(register_plain, ("scale", "shift"))
    gated = _registered(register_plain, ("scale", "shift"), gated=True)
    x = torch.zeros(1)
    configs = {
        "two plain pairs (bnb 0.49)": loop(partial(plain, x)),
        "one gate (bnb-gc-fix)": loop(partial(gated, x)),
    }
    result = harness.blocks(configs, calls, rounds, baseline="two plain pairs (bnb 0.49)")
    result["ratio"] = result["ratio_to_baseline"]["one gate (bnb-gc-fix)"]["median"]
    return result


def _two_quantized_module(numel: int, gated: bool) -> Any:
    """Two parameters quantized by ``replace_parameter_4bit``, both used by the forward."""
    import torch

    class TwoQuantized(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.scale = torch.nn.Parameter(torch.randn(numel, generator=generator), requires_grad=False)
            self.shift = torch.nn.Parameter(torch.randn(numel, generator=generator), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    module = common.quantized(TwoQuantized(), gated, names=("scale", "shift"))
    assert len(module._forward_pre_hooks) == (1 if gated else 2)
    return module


def two_quantized(calls: int, rounds: int, numel: int = 64) -> dict[str, Any]:
    """Case 2: two 4-bit parameters; two modules per configuration, so module-to-module noise shows."""
    import torch

    common.unpatched_bitsandbytes()
    names = ("plain A", "gate A", "plain B", "gate B")
    modules = {name: _two_quantized_module(numel, gated=name.startswith("gate")) for name in names}
    x = torch.ones(numel)
    common.same_outputs(modules, x)
    with torch.no_grad():
        raw = harness.blocks(
            {name: loop(partial(module, x)) for name, module in modules.items()}, calls, rounds, "plain A"
        )
    by_round = raw["ns_per_call_by_round"]
    plain_ns = [a + b for a, b in zip(by_round["plain A"], by_round["plain B"])]
    gate_ns = [a + b for a, b in zip(by_round["gate A"], by_round["gate B"])]
    comparison = harness.compare(gate_ns, plain_ns, floor=None, goal=1.00)
    control = harness.ratios(by_round["plain B"], by_round["plain A"])
    return {
        "calls_per_block": calls,
        "rounds": rounds,
        "baseline": "two plain pairs (bnb 0.49)",
        "modules_per_configuration": 2,
        "numel_per_parameter": numel,
        "median_ns_per_call": {
            "two plain pairs (bnb 0.49)": harness.median(plain_ns) / 2,
            "one gate (bnb-gc-fix)": harness.median(gate_ns) / 2,
        },
        "ratio_to_baseline": {"one gate (bnb-gc-fix)": comparison.ratio.record()},
        "control_plain_B_over_plain_A": harness.median(control),
        "noise_floor": harness.Spread.of(control).record(),
        "raw": raw,
        "goal": "gate / two plain pairs <= 1.00",
        "ratio": comparison.ratio.median,
        "met": comparison.met,
        "result": harness.verdict(comparison.ratio, harness.Spread.of(control)),
    }


def hooks_direct(calls: int, rounds: int) -> dict[str, Any]:
    """Case 3: the hook bodies called back to back, no module call."""
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    from bnb_gc_fix import gate

    enable = bnb_parametrize._enable_parametrization_cache
    disable = bnb_parametrize._disable_parametrization_cache
    disable = getattr(disable, "__wrapped__", disable)
    _, upstream_disable = common.upstream_hooks()
    gate_enter, gate_leave = gate.new_hooks(
        "bitsandbytes.nn.parametrize:_enable_parametrization_cache",
        "bitsandbytes.nn.parametrize:_disable_parametrization_cache",
    )
    pairs = {
        "plain enable+disable": (enable, disable),
        "upstream enable+disable": (enable, upstream_disable),
        "gate enter+exit": (gate_enter, gate_leave),
    }
    module = torch.nn.Module()
    args = (torch.zeros(1),)
    configs = {name: loop(_hook_pair(enter, leave, module, args)) for name, (enter, leave) in pairs.items()}
    result = harness.blocks(configs, calls, rounds, baseline="plain enable+disable")
    result["note"] = "one pre-hook call and one forward-hook call per iteration, no module call"
    return result


def _hook_pair(
    enter: Callable[..., None], leave: Callable[..., None], module: Any, args: Any
) -> Callable[[], None]:
    def call() -> None:
        enter(module, args)  # the gate's pre-hook records this frame as its hold's call
        leave(module, args, args[0])

    return call


def experts_model(layers: int, gated: bool) -> Any:
    """Case 4's model: ``layers`` 4-bit expert stacks in a row."""
    import torch

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.weight = torch.nn.Parameter(torch.randn(8, 128, 128, generator=generator) * 0.05)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("td,ehd->th", x, self.weight).tanh()

    model = torch.nn.Sequential(*(common.quantized(Experts(), gated) for _ in range(layers)))
    return model.requires_grad_(False)


def self_calling(gated: bool, chunks: int) -> Any:
    """Case 5's module: it splits its batch by calling itself on each of ``chunks`` chunks."""
    import torch

    class Chunked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.weight = torch.nn.Parameter(torch.randn(64, 64, generator=generator) * 0.05)

        def forward(self, x: torch.Tensor, whole: bool = True) -> torch.Tensor:
            if whole:  # split the batch and call itself on each chunk, as memory-bound code does
                return torch.cat([self(chunk, whole=False) for chunk in x.chunk(chunks)])
            return x @ self.weight.t()

    return common.quantized(Chunked(), gated)


def _under_frames(depth: int, call: Callable[[], Any]) -> Any:
    return call() if depth == 0 else _under_frames(depth - 1, call)


def _served(model: Any, x: Any, threads: int) -> Timed:
    """A block in which each of ``threads`` threads runs ``n`` no-grad forwards under 30 caller frames."""
    import torch

    def timed(n: int) -> int:
        barrier = threading.Barrier(threads + 1)

        def work() -> None:
            barrier.wait()
            with torch.no_grad():
                for _ in range(n):
                    _under_frames(30, partial(model, x))  # a server's call depth

        pool = [threading.Thread(target=work) for _ in range(threads)]
        for thread in pool:
            thread.start()
        barrier.wait()
        started = time.perf_counter_ns()
        for thread in pool:
            thread.join()
        return time.perf_counter_ns() - started

    return timed


def threads_case(threads: int, forwards: int, rounds: int) -> dict[str, Any]:
    """Case 4: one model served by ``threads`` threads at once, plain pairs against gates."""
    import torch

    common.unpatched_bitsandbytes()
    x = torch.randn(32, 128)
    floor = "plain pairs, a second model (noise floor)"
    models = {
        "plain pairs (bnb 0.49)": experts_model(6, False),
        "gates (bnb-gc-fix)": experts_model(6, True),
        floor: experts_model(6, False),
    }
    configs = {name: _served(model, x, threads) for name, model in models.items()}
    result = harness.blocks(configs, forwards, rounds, "plain pairs (bnb 0.49)")
    common.same_outputs(models, x)
    result["threads"] = threads
    result["note"] = "wall time of a block in which every thread runs calls_per_block forwards, per forward"
    return _goal(result, "gates (bnb-gc-fix)", "gates / plain pairs", 1.05, floor=floor)


def self_calls(calls: int, rounds: int, chunks: int = 128, depth: int = 100) -> dict[str, Any]:
    """Case 5: a module calling itself ``chunks`` times a forward, under ``depth`` caller frames."""
    import torch

    common.unpatched_bitsandbytes()
    x = torch.randn(chunks * 2, 64)
    floor = "plain pair, a second module (noise floor)"
    modules = {
        PLAIN: self_calling(False, chunks),
        GATE: self_calling(True, chunks),
        floor: self_calling(False, chunks),
    }
    common.same_outputs(modules, x)
    configs = {
        name: loop(partial(_under_frames, depth, partial(module, x))) for name, module in modules.items()
    }
    with torch.no_grad():
        result = harness.blocks(configs, calls, rounds, PLAIN)
    result["chunks"] = chunks
    result["caller_frames"] = depth
    return _goal(result, GATE, "gate / plain pair", 1.05, floor=floor)


TITLES = {
    "hooks_alone": "Hooks alone (forward returns its input)",
    "two_pairs_alone": "Two parameters' hooks alone (forward returns its input)",
    "two_quantized": "Two 4-bit parameters, forward uses both",
    "hooks_direct": "Hook bodies called directly",
    "threads_8": "8 threads serving one 6-layer model of 4-bit experts (no-grad forwards)",
    "threads_1": "The same model, 1 thread",
    "self_calls": "A 4-bit module calling itself (128 chunks a forward) under 100 caller frames",
}


def _case_markdown(title: str, case: dict[str, Any]) -> list[str]:
    baseline = case["baseline"]
    rows = []
    for name, value in case["median_ns_per_call"].items():
        ratio = "baseline" if name == baseline else harness.Spread(**case["ratio_to_baseline"][name]).text()
        rows.append([name, f"{value / 1e3:.2f} µs", ratio])
    header = ["configuration", "median per call", "ratio to baseline (median of rounds)"]
    lines = [f"**{title}**, {case['rounds']} rounds of {case['calls_per_block']:,} calls", ""]
    lines += harness.table(header, rows)
    if "control_plain_B_over_plain_A" in case:
        control = case["control_plain_B_over_plain_A"]
        lines += [
            "",
            f"Control, two identically built plain modules B / A: {control:.3f}x (this case's noise floor).",
        ]
    if "goal" in case:
        met = "met" if case["met"] else "NOT met"
        lines += ["", f"Goal {case['goal']}: {met} ({case['ratio']:.3f}x); result: **{case['result']}**."]
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
    forwards = 20 // scale or 1
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "hotpath",
        "machine": harness.machine(),
        "method": (
            "same process, configurations timed in blocks of calls, block order alternating every "
            "round, garbage collector off during blocks; ratio = median over rounds of block time / "
            "baseline block time of the same round"
        ),
        "hooks_alone": hooks_alone(2000 // scale, rounds),
        "two_pairs_alone": two_pairs_alone(2000 // scale, rounds),
        "two_quantized": two_quantized(20, 2 * rounds),
        "hooks_direct": hooks_direct(10000 // scale, rounds),
        "threads_8": threads_case(8, forwards, rounds),
        "threads_1": threads_case(1, forwards, rounds),
        "self_calls": self_calls(forwards, rounds),
    }
    result["wall_s"] = time.perf_counter() - started
    output = harness.output_path("hotpath.json", args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
