"""Hot-path benchmark: what one forward costs with the gate instead of bitsandbytes' plain pair.

Same process, same module class, alternating timed blocks; the figure is the median over
rounds of the per-round ratio (the configurations of a round run back to back, in an order
that alternates every round, so drift and noise from other processes hit them alike).

Case 1, hooks alone: a module whose forward returns its input, so the hooks are nearly all
the work. Configurations: no hooks (floor), bitsandbytes' plain pair (``_register_parametrization_hooks``
as shipped by 0.49), upstream 0.50's pair (``always_call=True``, clamped), and this package's
gate (the plain pair, then ``bnb_gc_fix.gate.install``). Goal: gate / plain <= 1.10.

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
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as common

Timed = Callable[[int], int]  # runs n calls, returns elapsed ns


def _plain_register() -> Callable[..., None]:
    import bitsandbytes.nn.parametrize as bnb_parametrize

    from bnb_gc_fix import patch

    if patch.is_applied(bnb_parametrize):  # bitsandbytes was patched before we could stop it
        patch.remove(bnb_parametrize)
    register: Callable[..., None] = bnb_parametrize._register_parametrization_hooks
    return register


def _loop(call: Callable[[], Any]) -> Timed:
    counter = time.perf_counter_ns

    def timed(n: int) -> int:
        started = counter()
        for _ in range(n):
            call()
        return counter() - started

    return timed


def _bound(module: Callable[[Any], Any], x: Any) -> Callable[[], Any]:
    """A no-argument call of ``module(x)``."""

    def call() -> Any:
        return module(x)

    return call


def _alternate(configs: dict[str, Timed], calls: int, rounds: int, baseline: str) -> dict[str, Any]:
    """Time ``calls`` calls of every configuration per round; the order alternates every round."""
    names = list(configs)
    for name in names:  # warm up
        configs[name](max(calls // 10, 1))
    per_call: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names if name != baseline}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for index in range(rounds):
            order = names if index % 2 == 0 else list(reversed(names))
            elapsed = {name: configs[name](calls) / calls for name in order}
            for name in names:
                per_call[name].append(elapsed[name])
                if name != baseline:
                    ratios[name].append(elapsed[name] / elapsed[baseline])
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "calls_per_block": calls,
        "rounds": rounds,
        "baseline": baseline,
        "median_ns_per_call": {name: common.median(values) for name, values in per_call.items()},
        "min_ns_per_call": {name: min(values) for name, values in per_call.items()},
        "ns_per_call_by_round": per_call,
        "ratio_to_baseline": {
            name: {
                "median": common.median(values),
                "min": min(values),
                "max": max(values),
            }
            for name, values in ratios.items()
        },
    }


def hooks_alone(calls: int, rounds: int) -> dict[str, Any]:
    import torch

    from bnb_gc_fix import gate

    register_plain = _plain_register()
    register_upstream, _ = common.upstream_hooks()

    class Passthrough(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    bare = Passthrough()
    plain = Passthrough()
    register_plain(plain, "weight")
    upstream = Passthrough()
    register_upstream(upstream, "weight")
    gated = Passthrough()
    register_plain(gated, "weight")
    assert gate.install(gated) and gate.gate_of(gated) is not None
    x = torch.zeros(1)
    configs = {
        "no hooks": _loop(lambda: bare(x)),
        "plain pair (bnb 0.49)": _loop(lambda: plain(x)),
        "upstream 0.50 pair": _loop(lambda: upstream(x)),
        "gate (bnb-gc-fix)": _loop(lambda: gated(x)),
    }
    result = _alternate(configs, calls, rounds, baseline="plain pair (bnb 0.49)")
    median = result["median_ns_per_call"]
    floor = median["no hooks"]
    result["hook_overhead_ns"] = {name: value - floor for name, value in median.items() if name != "no hooks"}
    result["hook_overhead_ratio_gate_over_plain"] = (median["gate (bnb-gc-fix)"] - floor) / (
        median["plain pair (bnb 0.49)"] - floor
    )
    result["goal"] = "gate / plain pair <= 1.10"
    result["ratio"] = result["ratio_to_baseline"]["gate (bnb-gc-fix)"]["median"]
    result["met"] = result["ratio"] <= 1.10
    return result


def two_pairs_alone(calls: int, rounds: int) -> dict[str, Any]:
    """Case 1 with two parameters: two plain pairs (what bnb registers) against one gate."""
    import torch

    from bnb_gc_fix import gate

    register_plain = _plain_register()

    class Passthrough(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            self.shift = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    plain = Passthrough()
    gated = Passthrough()
    for module in (plain, gated):
        register_plain(module, "scale")
        register_plain(module, "shift")
    assert gate.install(gated) and len(gated._forward_pre_hooks) == 1
    x = torch.zeros(1)
    configs = {
        "two plain pairs (bnb 0.49)": _loop(lambda: plain(x)),
        "one gate (bnb-gc-fix)": _loop(lambda: gated(x)),
    }
    result = _alternate(configs, calls, rounds, baseline="two plain pairs (bnb 0.49)")
    result["ratio"] = result["ratio_to_baseline"]["one gate (bnb-gc-fix)"]["median"]
    return result


def two_quantized(calls: int, rounds: int, numel: int) -> dict[str, Any]:
    """Two 4-bit parameters: two modules per configuration, so module-to-module noise shows."""
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    from bnb_gc_fix import gate

    _plain_register()

    class TwoQuantized(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.scale = torch.nn.Parameter(torch.randn(numel, generator=generator), requires_grad=False)
            self.shift = torch.nn.Parameter(torch.randn(numel, generator=generator), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale + self.shift

    def quantized() -> TwoQuantized:
        module = TwoQuantized()
        bnb_parametrize.replace_parameter_4bit(module, "scale", quant_type="nf4")
        bnb_parametrize.replace_parameter_4bit(module, "shift", quant_type="nf4")
        return module

    plain = {"plain A": quantized(), "gate A": quantized(), "plain B": quantized(), "gate B": quantized()}
    for name, module in plain.items():
        if name.startswith("gate"):
            assert gate.install(module) and len(module._forward_pre_hooks) == 1
        else:
            assert len(module._forward_pre_hooks) == 2 and len(module._forward_hooks) == 2
    x = torch.ones(numel)
    with torch.no_grad():
        outputs = [module(x) for module in plain.values()]
        assert all(torch.equal(outputs[0], output) for output in outputs)
        configs = {name: _loop(_bound(module, x)) for name, module in plain.items()}
        raw = _alternate(configs, calls, rounds, baseline="plain A")
    by_round = raw["ns_per_call_by_round"]
    gate_ratios = [
        (ga + gb) / (pa + pb)
        for pa, ga, pb, gb in zip(
            by_round["plain A"], by_round["gate A"], by_round["plain B"], by_round["gate B"]
        )
    ]
    control = [pb / pa for pa, pb in zip(by_round["plain A"], by_round["plain B"])]
    plain_ns = [(a + b) / 2 for a, b in zip(by_round["plain A"], by_round["plain B"])]
    gate_ns = [(a + b) / 2 for a, b in zip(by_round["gate A"], by_round["gate B"])]
    ratio = common.median(gate_ratios)
    result: dict[str, Any] = {
        "calls_per_block": calls,
        "rounds": rounds,
        "baseline": "two plain pairs (bnb 0.49)",
        "modules_per_configuration": 2,
        "numel_per_parameter": numel,
        "median_ns_per_call": {
            "two plain pairs (bnb 0.49)": common.median(plain_ns),
            "one gate (bnb-gc-fix)": common.median(gate_ns),
        },
        "ratio_to_baseline": {
            "one gate (bnb-gc-fix)": {
                "median": ratio,
                "min": min(gate_ratios),
                "max": max(gate_ratios),
            }
        },
        "control_plain_B_over_plain_A": common.median(control),
        "raw": raw,
        "goal": "gate / two plain pairs <= 1.00",
        "ratio": ratio,
        "met": ratio <= 1.00,
    }
    return result


def hooks_direct(calls: int, rounds: int) -> dict[str, Any]:
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    from bnb_gc_fix import gate

    enable = bnb_parametrize._enable_parametrization_cache
    disable = bnb_parametrize._disable_parametrization_cache
    disable = getattr(disable, "__wrapped__", disable)
    _, upstream_disable = common.upstream_hooks()
    module = torch.nn.Module()
    the_gate = gate.Gate()
    enter, leave = the_gate._enable_parametrization_cache, the_gate._disable_parametrization_cache
    args = (torch.zeros(1),)
    output = args[0]

    def plain() -> None:
        enable(module, args)
        disable(module, args, output)

    def upstream() -> None:
        enable(module, args)
        upstream_disable(module, args, output)

    def gated() -> None:
        enter(module, args)
        leave(module, args, output)

    configs = {
        "plain enable+disable": _loop(plain),
        "upstream enable+disable": _loop(upstream),
        "gate enter+exit": _loop(gated),
    }
    result = _alternate(configs, calls, rounds, baseline="plain enable+disable")
    result["note"] = "one pre-hook call and one forward-hook call per iteration, no module call"
    return result


class _Experts:
    """Factory of the concurrency cases' modules (built after torch is imported)."""

    @staticmethod
    def model(layers: int, gated: bool) -> Any:
        import bitsandbytes.nn.parametrize as bnb_parametrize
        import torch

        from bnb_gc_fix import gate

        class Experts(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                generator = torch.Generator().manual_seed(0)
                self.weight = torch.nn.Parameter(torch.randn(8, 128, 128, generator=generator) * 0.05)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.einsum("td,ehd->th", x, self.weight).tanh()

        model = torch.nn.Sequential(*(Experts() for _ in range(layers)))
        for layer in model:
            bnb_parametrize.replace_parameter_4bit(layer, "weight", quant_type="nf4")
            if gated:
                assert gate.install(layer)
            assert (gate.gate_of(layer) is not None) is gated
        return model.requires_grad_(False)

    @staticmethod
    def self_calling(gated: bool, chunks: int) -> Any:
        import bitsandbytes.nn.parametrize as bnb_parametrize
        import torch

        from bnb_gc_fix import gate

        class Chunked(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                generator = torch.Generator().manual_seed(0)
                self.weight = torch.nn.Parameter(torch.randn(64, 64, generator=generator) * 0.05)

            def forward(self, x: torch.Tensor, whole: bool = True) -> torch.Tensor:
                if whole:  # split the batch and call itself on each chunk, as memory-bound code does
                    return torch.cat([self(chunk, whole=False) for chunk in x.chunk(chunks)])
                return x @ self.weight.t()

        module = Chunked()
        bnb_parametrize.replace_parameter_4bit(module, "weight", quant_type="nf4")
        if gated:
            assert gate.install(module)
        assert (gate.gate_of(module) is not None) is gated
        return module.requires_grad_(False)


def _under_frames(depth: int, call: Callable[[], Any]) -> Any:
    return call() if depth == 0 else _under_frames(depth - 1, call)


def threads(threads: int, forwards: int, rounds: int) -> dict[str, Any]:
    """Case 4: one model served by ``threads`` threads at once, plain pairs against gates."""
    import threading

    import torch

    register_plain = _plain_register()
    assert register_plain is not None
    x = torch.randn(32, 128)
    models = {
        "plain pairs (bnb 0.49)": _Experts.model(6, False),
        "gates (bnb-gc-fix)": _Experts.model(6, True),
        "plain pairs, a second model (noise floor)": _Experts.model(6, False),
    }

    def served(model: Any) -> Timed:
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

    result = _alternate(
        {name: served(model) for name, model in models.items()}, forwards, rounds, "plain pairs (bnb 0.49)"
    )
    with torch.no_grad():
        outputs = [model(x) for model in models.values()]
    assert all(torch.equal(outputs[0], output) for output in outputs)
    result["threads"] = threads
    result["note"] = "wall time of a block in which every thread runs calls_per_block forwards, per forward"
    result["ratio"] = result["ratio_to_baseline"]["gates (bnb-gc-fix)"]["median"]
    result["goal"] = "gates / plain pairs <= 1.05"
    result["met"] = result["ratio"] <= 1.05
    return result


def self_calls(calls: int, rounds: int, chunks: int = 128, depth: int = 100) -> dict[str, Any]:
    """Case 5: a module calling itself ``chunks`` times a forward, under ``depth`` caller frames."""
    import torch

    _plain_register()
    x = torch.randn(chunks * 2, 64)
    modules = {
        "plain pair (bnb 0.49)": _Experts.self_calling(False, chunks),
        "gate (bnb-gc-fix)": _Experts.self_calling(True, chunks),
        "plain pair, a second module (noise floor)": _Experts.self_calling(False, chunks),
    }
    with torch.no_grad():
        outputs = [module(x) for module in modules.values()]
        assert all(torch.equal(outputs[0], output) for output in outputs)

        def deep(module: Any) -> Timed:
            return _loop(lambda: _under_frames(depth, lambda: module(x)))

        result = _alternate(
            {name: deep(module) for name, module in modules.items()}, calls, rounds, "plain pair (bnb 0.49)"
        )
    result["chunks"] = chunks
    result["caller_frames"] = depth
    result["ratio"] = result["ratio_to_baseline"]["gate (bnb-gc-fix)"]["median"]
    result["goal"] = "gate / plain pair <= 1.05"
    result["met"] = result["ratio"] <= 1.05
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for key, title in (
        ("hooks_alone", "Hooks alone (forward returns its input)"),
        ("two_pairs_alone", "Two parameters' hooks alone (forward returns its input)"),
        ("two_quantized", "Two 4-bit parameters, forward uses both"),
        ("hooks_direct", "Hook bodies called directly"),
        ("threads_8", "8 threads serving one 6-layer model of 4-bit experts (no-grad forwards)"),
        ("threads_1", "The same model, 1 thread"),
        ("self_calls", "A 4-bit module calling itself (128 chunks a forward) under 100 caller frames"),
    ):
        if key not in result:
            continue
        case = result[key]
        baseline = case["baseline"]
        lines += [f"**{title}**, {case['rounds']} rounds of {case['calls_per_block']:,} calls", ""]
        lines += [
            "| configuration | median per call | ratio to baseline (median of rounds) |",
            "|---|---:|---:|",
        ]
        for name, value in case["median_ns_per_call"].items():
            ratio = "baseline" if name == baseline else f"{case['ratio_to_baseline'][name]['median']:.3f}x"
            lines.append(f"| {name} | {value / 1e3:.2f} µs | {ratio} |")
        if "control_plain_B_over_plain_A" in case:
            lines.append("")
            lines.append(
                "Control, two identically built plain modules B / A: "
                f"{case['control_plain_B_over_plain_A']:.3f}x "
                "(the noise floor of this case)."
            )
        if "goal" in case:
            lines.append("")
            lines.append(
                f"Goal {case['goal']}: {'met' if case['met'] else 'NOT met'} ({case['ratio']:.3f}x)."
            )
        lines.append("")
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
        "machine": common.machine(),
        "method": (
            "same process, configurations timed in blocks of calls, block order alternating every "
            "round, garbage collector off during blocks; ratio = median over rounds of block time / "
            "baseline block time of the same round"
        ),
    }
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "hooks_alone": lambda: hooks_alone(2000 // scale, rounds),
        "two_pairs_alone": lambda: two_pairs_alone(2000 // scale, rounds),
        "two_quantized": lambda: two_quantized(20, 2 * rounds, args.numel),
        "hooks_direct": lambda: hooks_direct(10000 // scale, rounds),
        "threads_8": lambda: threads(8, 20 // scale or 1, rounds),
        "threads_1": lambda: threads(1, 20 // scale or 1, rounds),
        "self_calls": lambda: self_calls(20 // scale or 1, rounds),
    }
    for name, case in cases.items():
        if not args.cases or name in args.cases:
            result[name] = case()
    result["wall_s"] = time.perf_counter() - started
    folder = common.RESULTS / "tmp" if args.quick else common.RESULTS
    output: Path = args.output or folder / "hotpath.json"
    common.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
