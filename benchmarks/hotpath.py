"""Hot-path benchmark: what a forward of a MoE experts module (two parameters quantized by
``replace_parameter_4bit``) costs with the fix, against bitsandbytes 0.50's own always-called pairs on the
same module; a second 0.50 module is the noise floor, bitsandbytes 0.49's plain pairs a reference. Four
cases: the hook bodies called directly, the hooks through torch's ``Module.__call__``, a real 4-bit
forward on one thread, the same module served from 8 threads (benchmarks/README.md, "Hot path").

    python benchmarks/hotpath.py            # writes results/hotpath.json, .md
    python benchmarks/hotpath.py --quick    # 5 rounds of fewer calls (smoke run, results/tmp/)
"""

from __future__ import annotations

import os

os.environ["BNB_GC_FIX"] = "0"  # before bitsandbytes is imported: the fix goes in by hand, below

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import _harness as harness

BASELINE = "bnb 0.50 pairs"
FIX = "bnb-gc-fix"
FLOOR = "bnb 0.50 pairs, a second module (noise floor)"
PLAIN = "bnb 0.49 plain pairs (reference)"
#: The hooks each module carries after quantization: (pre-hooks, forward hooks, always-called ones).
HOOKS = {BASELINE: (2, 2, 2), FIX: (1, 1, 1), FLOOR: (2, 2, 2), PLAIN: (2, 2, 0)}
NAMES = ("gate_up_proj", "down_proj")  # transformers 5's fused experts
EXPERTS, HIDDEN, INTERMEDIATE, TOKENS = 8, 64, 64, 8


def registers() -> dict[str, Callable[..., None] | None]:
    """Each configuration's ``_register_parametrization_hooks`` (None: bitsandbytes' own, which the fix
    wraps). The references' hook functions are copies made before ``patch.apply`` gives the fix's code to
    bitsandbytes' own functions, process-wide, as the start-up hook does."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    import _bnb_gc_fix
    from bnb_gc_fix import patch

    upstream = harness.upstream_hooks()[0]
    enable = harness.copy_of(bnb_parametrize._enable_parametrization_cache)
    disable = harness.copy_of(bnb_parametrize._disable_parametrization_cache)
    plain = harness.register_with(enable, disable, always_call=False)
    patch.apply(bnb_parametrize, _bnb_gc_fix.BITSANDBYTES)
    return {BASELINE: upstream, FIX: None, FLOOR: upstream, PLAIN: plain}


@contextlib.contextmanager
def registering(register: Callable[..., None] | None) -> Iterator[None]:
    """bitsandbytes' ``_register_parametrization_hooks`` is ``register`` inside the block (None: as is)."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    own = bnb_parametrize._register_parametrization_hooks
    if register is not None:
        bnb_parametrize._register_parametrization_hooks = register
    try:
        yield
    finally:
        bnb_parametrize._register_parametrization_hooks = own


def experts_module(name: str, register: Callable[..., None] | None) -> Any:
    """A MoE experts module, transformers 5's fused layout (``gate_up_proj`` [experts, 2 x intermediate,
    hidden], ``down_proj`` [experts, hidden, intermediate]), both quantized by ``replace_parameter_4bit``
    (nf4) with ``register``; every token goes through every expert (dense), so the forward uses both."""
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    from bnb_gc_fix import gate

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

    module = Experts()
    with registering(register):
        for parameter in NAMES:
            bnb_parametrize.replace_parameter_4bit(module, parameter, quant_type="nf4")
    hooks = (
        len(module._forward_pre_hooks),
        len(module._forward_hooks),
        len(module._forward_hooks_always_called),
    )
    assert hooks == HOOKS[name], (name, hooks)
    assert gate.is_taken_over(module) is (name == FIX), name
    return module.requires_grad_(False)


def experts_modules(made: dict[str, Callable[..., None] | None]) -> dict[str, Any]:
    return {name: experts_module(name, register) for name, register in made.items()}


def same_outputs(modules: dict[str, Any], x: Any) -> None:
    """Every configuration's module computes the same output (no grad)."""
    import torch

    with torch.no_grad():
        outputs = [module(x) for module in modules.values()]
    assert all(torch.equal(outputs[0], output) for output in outputs)


def _case(result: dict[str, Any]) -> dict[str, Any]:
    """Every configuration's ratio to the baseline, and the fix's reading against the noise floor."""
    by_round = result["ns_per_call_by_round"]
    result["ratio_to_baseline"] = {
        name: harness.Spread.of(harness.ratios(values, by_round[BASELINE])).record()
        for name, values in by_round.items()
        if name != BASELINE
    }
    result["fix_over_baseline"] = harness.compare(by_round[FIX], by_round[BASELINE], by_round[FLOOR])
    return result


def _hook_bodies(module: Any) -> Callable[[], None]:
    """One forward's hooks of ``module``, called as torch calls them (pre-hooks, then forward hooks, each
    in order), without the module call."""
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


def hook_bodies(made: dict[str, Any], calls: int, rounds: int) -> dict[str, Any]:
    """Case a: the hook bodies of the experts module, called directly."""
    modules = experts_modules(made)
    configs = {name: harness.loop(_hook_bodies(module)) for name, module in modules.items()}
    return _case(harness.blocks(configs, calls, rounds, BASELINE))


def _passthrough(x: Any) -> Any:
    return x


def hooks_through_call(made: dict[str, Any], calls: int, rounds: int) -> dict[str, Any]:
    """Case a2: the hooks through torch's module call, the forward one that returns its input (torch's
    dispatch of the hooks, always-called ones included, is the work)."""
    import torch

    modules = experts_modules(made)
    for module in modules.values():
        module.forward = _passthrough
    x = torch.zeros(1)
    configs = {name: harness.loop(partial(module, x)) for name, module in modules.items()}
    return _case(harness.blocks(configs, calls, rounds, BASELINE))


def forward_one_thread(made: dict[str, Any], calls: int, rounds: int) -> dict[str, Any]:
    """Case b: a real no-grad 4-bit forward of the experts module (both parameters dequantized), one
    thread."""
    import torch

    modules = experts_modules(made)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    same_outputs(modules, x)
    with torch.no_grad():
        configs = {name: harness.loop(partial(module, x)) for name, module in modules.items()}
        result = harness.blocks(configs, calls, rounds, BASELINE)
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


def served(made: dict[str, Any], threads: int, forwards: int, rounds: int) -> dict[str, Any]:
    """Case c: the experts module served from ``threads`` threads at once."""
    import torch

    modules = experts_modules(made)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    same_outputs(modules, x)
    pools = {name: _Pool(module, x, threads) for name, module in modules.items()}
    try:
        configs: dict[str, harness.Timed] = {name: pool.timed for name, pool in pools.items()}
        result = harness.blocks(configs, forwards, rounds, BASELINE)
    finally:
        for pool in pools.values():
            pool.close()
    result["threads"] = threads
    return _case(result)


TITLES = {
    "hook_bodies": "a. Hook bodies called directly (0.50: two enable, two disable hooks; the fix: one pair)",
    "hooks_through_call": "a2. The same hooks through torch's Module.__call__, forward returns its input",
    "forward_1_thread": "b. A real 4-bit forward of the experts module, 1 thread",
    "forward_8_threads": "c. The same module served from 8 threads (per forward of one thread, all at once)",
}


def _case_markdown(title: str, case: dict[str, Any]) -> list[str]:
    rows = []
    for name, value in case["median_ns_per_call"].items():
        ratio = "baseline" if name == BASELINE else harness.Spread(**case["ratio_to_baseline"][name]).text()
        rows.append([name, f"{value / 1e3:.3f} µs", ratio])
    header = ["configuration", "median per call", "ratio to 0.50 pairs: median of rounds (IQR)"]
    lines = [f"**{title}**, {case['rounds']} rounds of {case['calls_per_block']:,} calls", ""]
    lines += harness.table(header, rows)
    comparison = case["fix_over_baseline"]
    ratio = harness.Spread(**comparison["ratio"]).text()
    floor = harness.Spread(**comparison["noise_floor"]).text()
    lines += ["", f"bnb-gc-fix / 0.50 pairs {ratio}; noise floor {floor}: **{comparison['result']}**."]
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
    started = time.perf_counter()
    made = registers()
    result: dict[str, Any] = {
        "benchmark": "hotpath",
        "machine": harness.machine(),
        "method": (
            "one process, configurations timed in blocks of calls, block order alternating every round, "
            "garbage collector off during blocks, wall time; ratio = median over rounds of block time / "
            "the 0.50 pairs' block time of the same round, with the interquartile range; noise floor: a "
            "second 0.50-pairs module timed in the same rounds"
        ),
        "configurations": {
            BASELINE: "0.50.2's disable hook, always called, after a copy of the installed enable hook",
            FIX: "bitsandbytes' own functions given the fix's code by bnb_gc_fix.patch.apply, one pair",
            FLOOR: "as the baseline, a second module",
            PLAIN: "copies of bitsandbytes 0.49.2's own enable and disable hook, registered as it does",
        },
        "shape": {
            "gate_up_proj": [EXPERTS, 2 * INTERMEDIATE, HIDDEN],
            "down_proj": [EXPERTS, HIDDEN, INTERMEDIATE],
        },
        "hook_bodies": hook_bodies(made, 10000 // scale, rounds),
        "hooks_through_call": hooks_through_call(made, 2000 // scale, rounds),
        "forward_1_thread": forward_one_thread(made, 200 // scale, rounds),
        "forward_8_threads": served(made, 8, 40 // scale, rounds),
    }
    result["wall_s"] = time.perf_counter() - started
    output = harness.output_path("hotpath.json", args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
