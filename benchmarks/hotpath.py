"""Hot-path benchmark: what one forward costs with the gate instead of bitsandbytes' plain pair.

Same process, same module class, alternating timed blocks; the figure is the median over
rounds of the per-round ratio (the configurations of a round run back to back, in an order
that alternates every round, so drift and noise from other processes hit them alike).

Case 1, hooks alone: a module whose forward returns its input, so the hooks are nearly all
the work. Configurations: no hooks (floor), bitsandbytes' plain pair (``_register_parametrization_hooks``
as shipped by 0.49), upstream 0.50's pair (``always_call=True``, clamped), and this package's
gate (the plain pair, then ``bnb_gc_fix.hooks.install``). Goal: gate / plain <= 1.10.

Case 1b, the same with two parameters: two plain pairs (what bitsandbytes registers for a
module with two quantized parameters) against one gate, still with a trivial forward.

Case 2, two quantized parameters: a module with two parameters quantized by
``replace_parameter_4bit`` whose forward uses both, so bitsandbytes registers two plain pairs
where the package has one gate. Goal: gate / plain <= 1.00. On CPU bitsandbytes' dequantization
(hundreds of µs per call) dwarfs the hooks, so this ratio is 1.00 within noise; case 1b shows
the hooks' share.

Case 3, the hooks called directly (no module call): the pre-hook and the forward hook of each
configuration, called back to back; shows the cost of the hook bodies themselves.

Case 4, threads: one 6-layer model of 4-bit experts served by 8 threads at once (a thread pool in
an inference server), no-grad forwards; and the same with 1 thread. Wall time of a block in which
every thread runs its forwards, plain pairs against gates. Goal <= 1.05.

Case 5, self-calls: a 4-bit module that splits its batch by calling itself (128 chunks a forward),
called under 100 caller frames. Goal <= 1.05.

Cases 4 and 5 time a second, identically built plain configuration beside the others: its ratio to
the first is the noise floor of the case.

The script runs with ``BNB_GC_FIX=0`` so that bitsandbytes stays unpatched and every
configuration is built explicitly.

    python benchmarks/hotpath.py            # writes results/hotpath.json
    python benchmarks/hotpath.py --quick    # fewer rounds (smoke run)
"""

from __future__ import annotations

import os

os.environ["BNB_GC_FIX"] = "0"  # before bitsandbytes is imported: configurations are built by hand

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common
import _harness as harness
from _harness import Timed, loop


def _plain_register() -> Callable[..., None]:
    """bitsandbytes' own ``_register_parametrization_hooks`` (unpatched if the start-up hook patched it)."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    from bnb_gc_fix import patch, targets

    if patch.is_applied(bnb_parametrize, targets.BITSANDBYTES):
        patch.remove(bnb_parametrize, targets.BITSANDBYTES)
    register: Callable[..., None] = bnb_parametrize._register_parametrization_hooks
    return register


def _bound(module: Callable[[Any], Any], x: Any) -> Callable[[], Any]:
    """A no-argument call of ``module(x)``."""

    def call() -> Any:
        return module(x)

    return call


def _goal(
    result: dict[str, Any], name: str, label: str, goal: float, floor: str | None = None
) -> dict[str, Any]:
    """Add the case's figure (``name``'s ratio), its goal, whether it is met, and how it reads (the floor's
    interquartile range, or with no floor 1, against the ratio)."""
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

    register_plain = _plain_register()
    register_upstream, _ = common.upstream_hooks()
    modules = {
        "no hooks": _passthrough(("weight",)),
        "plain pair (bnb 0.49)": _registered(register_plain, ("weight",)),
        "upstream 0.50 pair": _registered(register_upstream, ("weight",)),
        "gate (bnb-gc-fix)": _registered(register_plain, ("weight",), gated=True),
    }
    x = torch.zeros(1)
    configs = {name: loop(_bound(module, x)) for name, module in modules.items()}
    result = harness.blocks(configs, calls, rounds, baseline="plain pair (bnb 0.49)")
    median = result["median_ns_per_call"]
    floor = median["no hooks"]
    result["hook_overhead_ns"] = {name: value - floor for name, value in median.items() if name != "no hooks"}
    gate_overhead = median["gate (bnb-gc-fix)"] - floor
    result["hook_overhead_ratio_gate_over_plain"] = gate_overhead / (median["plain pair (bnb 0.49)"] - floor)
    return _goal(result, "gate (bnb-gc-fix)", "gate / plain pair", 1.10)


def two_pairs_alone(calls: int, rounds: int) -> dict[str, Any]:
    """Case 1b: two parameters, two plain pairs (what bnb registers) against one gate."""
    import torch

    register_plain = _plain_register()
    plain = _registered(register_plain, ("scale", "shift"))
    gated = _registered(register_plain, ("scale", "shift"), gated=True)
    x = torch.zeros(1)
    configs = {
        "two plain pairs (bnb 0.49)": loop(_bound(plain, x)),
        "one gate (bnb-gc-fix)": loop(_bound(gated, x)),
    }
    result = harness.blocks(configs, calls, rounds, baseline="two plain pairs (bnb 0.49)")
    result["ratio"] = result["ratio_to_baseline"]["one gate (bnb-gc-fix)"]["median"]
    return result


def _two_quantized_module(numel: int) -> Any:
    """Two parameters quantized by ``replace_parameter_4bit``, both used by the forward."""
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    class TwoQuantized(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.scale = torch.nn.Parameter(torch.randn(numel, generator=generator), requires_grad=False)
            self.shift = torch.nn.Parameter(torch.randn(numel, generator=generator), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    module = TwoQuantized()
    bnb_parametrize.replace_parameter_4bit(module, "scale", quant_type="nf4")
    bnb_parametrize.replace_parameter_4bit(module, "shift", quant_type="nf4")
    return module


def two_quantized(calls: int, rounds: int, numel: int) -> dict[str, Any]:
    """Case 2: two 4-bit parameters; two modules per configuration, so module-to-module noise shows."""
    import torch

    from bnb_gc_fix import hooks

    _plain_register()
    modules = {name: _two_quantized_module(numel) for name in ("plain A", "gate A", "plain B", "gate B")}
    for name, module in modules.items():
        if name.startswith("gate"):
            assert hooks.install(module) and len(module._forward_pre_hooks) == 1
        else:
            assert len(module._forward_pre_hooks) == 2 and len(module._forward_hooks) == 2
    x = torch.ones(numel)
    with torch.no_grad():
        outputs = [module(x) for module in modules.values()]
        assert all(torch.equal(outputs[0], output) for output in outputs)
        configs = {name: loop(_bound(module, x)) for name, module in modules.items()}
        raw = harness.blocks(configs, calls, rounds, baseline="plain A")
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
    enter, leave = gate.new_hooks(
        "bitsandbytes.nn.parametrize:_enable_parametrization_cache",
        "bitsandbytes.nn.parametrize:_disable_parametrization_cache",
    )
    pairs = {
        "plain enable+disable": (enable, disable),
        "upstream enable+disable": (enable, upstream_disable),
        "gate enter+exit": (enter, leave),
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
        enter(module, args)
        leave(module, args, args[0])

    return call


def _quantized(module: Any, gated: bool) -> Any:
    """``module`` with its ``weight`` quantized (nf4), with the gate or bitsandbytes' plain pair."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    from bnb_gc_fix import gate, hooks

    bnb_parametrize.replace_parameter_4bit(module, "weight", quant_type="nf4")
    if gated:
        assert hooks.install(module)
    assert (gate.Gate.of(module) is not None) is gated
    return module.requires_grad_(False)


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

    model = torch.nn.Sequential(*(_quantized(Experts(), gated) for _ in range(layers)))
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

    return _quantized(Chunked(), gated)


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
                    _under_frames(30, lambda: model(x))  # a server's call depth

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

    _plain_register()
    x = torch.randn(32, 128)
    models = {
        "plain pairs (bnb 0.49)": experts_model(6, False),
        "gates (bnb-gc-fix)": experts_model(6, True),
        "plain pairs, a second model (noise floor)": experts_model(6, False),
    }
    configs = {name: _served(model, x, threads) for name, model in models.items()}
    result = harness.blocks(configs, forwards, rounds, "plain pairs (bnb 0.49)")
    with torch.no_grad():
        outputs = [model(x) for model in models.values()]
    assert all(torch.equal(outputs[0], output) for output in outputs)
    result["threads"] = threads
    result["note"] = "wall time of a block in which every thread runs calls_per_block forwards, per forward"
    return _goal(
        result,
        "gates (bnb-gc-fix)",
        "gates / plain pairs",
        1.05,
        floor="plain pairs, a second model (noise floor)",
    )


def self_calls(calls: int, rounds: int, chunks: int = 128, depth: int = 100) -> dict[str, Any]:
    """Case 5: a module calling itself ``chunks`` times a forward, under ``depth`` caller frames."""
    import torch

    _plain_register()
    x = torch.randn(chunks * 2, 64)
    modules = {
        "plain pair (bnb 0.49)": self_calling(False, chunks),
        "gate (bnb-gc-fix)": self_calling(True, chunks),
        "plain pair, a second module (noise floor)": self_calling(False, chunks),
    }
    with torch.no_grad():
        outputs = [module(x) for module in modules.values()]
        assert all(torch.equal(outputs[0], output) for output in outputs)
        configs = {name: loop(_deep(module, x, depth)) for name, module in modules.items()}
        result = harness.blocks(configs, calls, rounds, "plain pair (bnb 0.49)")
    result["chunks"] = chunks
    result["caller_frames"] = depth
    return _goal(
        result,
        "gate (bnb-gc-fix)",
        "gate / plain pair",
        1.05,
        floor="plain pair, a second module (noise floor)",
    )


def _deep(module: Any, x: Any, depth: int) -> Callable[[], Any]:
    def call() -> Any:
        return _under_frames(depth, lambda: module(x))

    return call


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
        if key in result:
            lines += _case_markdown(title, result[key])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--numel", type=int, default=64, help="elements per quantized parameter in case 2")
    parser.add_argument("--quick", action="store_true", help="5 rounds of fewer calls")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="only these cases (default: all)")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    rounds = 5 if args.quick else args.rounds
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
    }
    forwards = 20 // scale or 1
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "hooks_alone": lambda: hooks_alone(2000 // scale, rounds),
        "two_pairs_alone": lambda: two_pairs_alone(2000 // scale, rounds),
        "two_quantized": lambda: two_quantized(20, 2 * rounds, args.numel),
        "hooks_direct": lambda: hooks_direct(10000 // scale, rounds),
        "threads_8": lambda: threads_case(8, forwards, rounds),
        "threads_1": lambda: threads_case(1, forwards, rounds),
        "self_calls": lambda: self_calls(forwards, rounds),
    }
    for name, case in cases.items():
        if not args.cases or name in args.cases:
            result[name] = case()
    result["wall_s"] = time.perf_counter() - started
    output = harness.output_path("hotpath.json", args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
