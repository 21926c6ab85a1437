"""Hot-path benchmark: what a forward of a MoE experts module (two parameters quantized by
``replace_parameter_4bit``) costs with the fix, against bitsandbytes 0.50's own always-called pairs on the
same module, a second 0.50 module being the noise floor. Three cases: the hook bodies called directly, a
real 4-bit forward on one thread, the same module served from 8 threads. Two more on small modules, where
the hooks weigh most, against bitsandbytes 0.49.2's own plain pair (a fresh copy of its functions, which
the fix never sees), a second such module being the noise floor: the hooks alone on an ``nn.Linear(8,
8)``, a module of two quantized 4x64x64 weights, and blocks of one quantized weight that call themselves
one and two deep, 64 and 256 wide (benchmarks/README.md, "Hot path").

    python benchmarks/hotpath.py            # results/hotpath.md
    python benchmarks/hotpath.py --quick    # 5 rounds of fewer calls (smoke run, results/tmp/)
"""

from __future__ import annotations

import os

os.environ["BNB_GC_FIX"] = "0"  # before bitsandbytes is imported: the fix goes in by hand, below

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _harness as harness

BASELINE = "bnb 0.50 pairs"
FIX = "bnb-gc-fix"
FLOOR = "bnb 0.50 pairs, a second module"
PLAIN = "bnb 0.49.2 pairs"
PLAIN_FLOOR = "bnb 0.49.2 pairs, a second module"
#: The hooks each module carries once quantized: (pre-hooks, forward hooks, always-called ones).
HOOKS = {BASELINE: (2, 2, 2), FIX: (1, 1, 1), FLOOR: (2, 2, 2), PLAIN: (2, 2, 0), PLAIN_FLOOR: (2, 2, 0)}
NAMES = ("gate_up_proj", "down_proj")  # transformers 5's fused experts
EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, THREADS = 8, 64, 64, 8, 8
SMALL = (4, 64, 64)  # the small module's two quantized weights


def registers() -> dict[str, Callable[..., None] | None]:
    """Each configuration's ``_register_parametrization_hooks`` (None: bitsandbytes' own, which the fix
    wraps). The fix goes in as the start-up hook puts it in: bitsandbytes' two hook functions get its code,
    process-wide, and its register function covers each module it quantizes."""
    import bitsandbytes.nn.parametrize  # noqa: F401 (before the fix is on: bitsandbytes' own code)

    upstream = harness.upstream_register()  # copies of bitsandbytes' functions, made before the fix is in
    plain = harness.plain_register()
    os.environ["BNB_GC_FIX"] = "auto"
    import bnb_gc_fix

    assert bnb_gc_fix.activate().libraries[0].fixed
    return {BASELINE: upstream, FIX: None, FLOOR: upstream, PLAIN: plain, PLAIN_FLOOR: plain}


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

    from bnb_gc_fix import cover

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
    always = module._forward_hooks_always_called
    hooks = (len(module._forward_pre_hooks), len(module._forward_hooks), len(always))
    assert hooks == HOOKS[name], (name, hooks)
    assert (id(module) in cover.covered_ids()) is (name == FIX), name
    return module.requires_grad_(False)


def experts_modules(registers_: dict[str, Callable[..., None] | None]) -> dict[str, Any]:
    """One experts module per configuration, their outputs checked equal."""
    return _checked_equal({name: experts_module(name, register) for name, register in registers_.items()})


def _checked_equal(modules: dict[str, Any], width: int = HIDDEN) -> dict[str, Any]:
    """``modules``, once their outputs on the same tokens are equal."""
    import torch

    with torch.no_grad():
        outputs = [module(tokens(width)) for module in modules.values()]
    assert all(torch.equal(outputs[0], output) for output in outputs)
    return modules


def small_modules(registers_: dict[str, Callable[..., None] | None]) -> dict[str, dict[str, Any]]:
    """For each small case, a module per configuration (the fix, 0.49.2's pairs, a second such module):
    an ``nn.Linear(8, 8)`` with one pair registered on it (the hooks alone), and a module of two quantized
    ``SMALL`` weights."""
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    from bnb_gc_fix import cover

    class TwoWeights(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.w0 = torch.nn.Parameter(torch.randn(*SMALL, generator=generator) * 0.05)
            self.w1 = torch.nn.Parameter(torch.randn(*SMALL, generator=generator) * 0.05)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.einsum("th,eoh->to", x, self.w0)
            return torch.einsum("th,eoh->to", y, self.w1)

    names = (FIX, PLAIN, PLAIN_FLOOR)
    linears, pairs = {}, {}
    for name in names:
        with registering(registers_[name]):
            torch.manual_seed(0)
            linears[name] = torch.nn.Linear(8, 8)
            bnb_parametrize._register_parametrization_hooks(linears[name], "weight")
            pairs[name] = TwoWeights()
            for parameter in ("w0", "w1"):
                bnb_parametrize.replace_parameter_4bit(pairs[name], parameter, quant_type="nf4")
        covered = [id(module) in cover.covered_ids() for module in (linears[name], pairs[name])]
        assert covered == [name == FIX] * 2, name
    return {
        "linear": _checked_equal({name: module.requires_grad_(False) for name, module in linears.items()}, 8),
        "two weights": _checked_equal({name: module.requires_grad_(False) for name, module in pairs.items()}),
    }


def self_calling_modules(registers_: dict[str, Callable[..., None] | None], width: int) -> dict[str, Any]:
    """For the fix, 0.49.2's pairs and a second such module: a block of one quantized ``width`` x ``width``
    weight that calls itself inside its forward, as a weight-shared recursive block does (``depth`` deep),
    using the weight before and after."""
    import bitsandbytes.nn.parametrize as bnb_parametrize
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(width, width, generator=generator) * 0.05)

        def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
            x = x @ self.w
            if depth:
                x = self(x, depth - 1)
            return x @ self.w.t()

    blocks = {}
    for name in (FIX, PLAIN, PLAIN_FLOOR):
        with registering(registers_[name]):
            blocks[name] = Block()
            bnb_parametrize.replace_parameter_4bit(blocks[name], "w", quant_type="nf4")
    return _checked_equal({name: block.requires_grad_(False) for name, block in blocks.items()}, width)


def self_call(module: Any, width: int, depth: int) -> Callable[[], Any]:
    """A no-grad forward of a self-calling block, ``depth`` calls of itself deep, on 2 rows."""
    import torch

    x = torch.randn(2, width, generator=torch.Generator().manual_seed(1))

    def call() -> Any:
        with torch.no_grad():
            return module(x, depth)

    return call


def tokens(width: int = HIDDEN) -> Any:
    import torch

    return torch.randn(TOKENS, width, generator=torch.Generator().manual_seed(1))


def hook_bodies(module: Any) -> Callable[[], None]:
    """One forward's hooks of ``module``, called as torch calls them (each pre-hook, then each forward
    hook), without the module call."""
    pre_hooks = tuple(module._forward_pre_hooks.values())
    forward_hooks = tuple(module._forward_hooks.values())
    args = (None,)

    def call() -> None:
        for hook in pre_hooks:
            hook(module, args)
        for hook in forward_hooks:
            hook(module, args, None)

    return call


def forward(module: Any, width: int = HIDDEN) -> Callable[[], Any]:
    """A no-grad forward of ``module`` (a quantized one's parameters dequantized)."""
    import torch

    x = tokens(width)

    def call() -> Any:
        with torch.no_grad():
            return module(x)

    return call


class Pool:
    """``threads`` threads that stay up for the whole case (a server's pool): each block, every one runs
    ``n`` forwards of ``module``; the block's time is the wall time from the start to the last one done."""

    def __init__(self, module: Any, threads: int) -> None:
        self.call = forward(module)
        self.n = 0
        self.start = threading.Barrier(threads + 1)
        self.done = threading.Barrier(threads + 1)
        self.stopping = False
        self.threads = [threading.Thread(target=self._serve, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _serve(self) -> None:
        while True:
            self.start.wait()
            if self.stopping:
                return
            for _ in range(self.n):
                self.call()
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


def case(
    title: str,
    configs: dict[str, harness.Timed],
    calls: int,
    rounds: int,
    unit: str = "calls",
    against: tuple[str, str] = (BASELINE, FLOOR),
) -> dict[str, Any]:
    """Time a case in blocks of ``calls`` calls; its record: every configuration's median ns per call, and
    the fix against ``against``'s baseline beside its noise floor (the same pairs on a second module)."""
    baseline, floor = against
    by_round = harness.blocks(configs, calls, rounds)
    found = harness.compare(by_round[FIX], by_round[baseline], by_round[floor])
    found["title"] = f"{title} ({rounds} rounds x {calls:,} {unit})"
    found["baseline"] = baseline
    found["median_ns"] = {name: harness.Spread.of(values).median for name, values in by_round.items()}
    found["ns_by_round"] = by_round
    return found


def served(modules: dict[str, Any], calls: int, rounds: int) -> dict[str, Any]:
    """Case c: each module served from ``THREADS`` threads at once."""
    pools = {name: Pool(module, THREADS) for name, module in modules.items()}
    try:
        timed: dict[str, harness.Timed] = {name: pool.timed for name, pool in pools.items()}
        title = f"c. the same from {THREADS} threads at once, per forward of each thread"
        return case(title, timed, calls, rounds, unit="forwards a thread")
    finally:
        for pool in pools.values():
            pool.close()


def markdown(result: dict[str, Any]) -> str:
    header = ["case", "against", "it", "bnb-gc-fix", "bnb-gc-fix / it", "noise floor", "result"]
    rows = []
    for found in result["cases"]:
        baseline = found["baseline"]
        rows.append(
            [
                found["title"],
                baseline,
                f"{found['median_ns'][baseline] / 1e3:.3f} µs",
                f"{found['median_ns'][FIX] / 1e3:.3f} µs",
                harness.Spread(**found["ratio"]).text(),
                harness.Spread(**found["noise_floor"]).text(),
                f"**{found['result']}**",
            ]
        )
    preamble = (
        "Per call: the median of the blocks' times; ratios: the median of the per-round ratios "
        "(interquartile range); torch on 1 thread."
    )
    return harness.page(preamble, header, rows, result["machine"])


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--quick", action="store_true", help="5 rounds of fewer calls")
    parser.add_argument("--output", type=Path, help="the raw JSON (its .md beside it)")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    rounds = 5 if args.quick else args.rounds
    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # bitsandbytes' CPU backend, every call
    torch.set_num_threads(1)
    machine = harness.machine()
    registers_ = registers()
    big = {name: registers_[name] for name in (BASELINE, FIX, FLOOR)}
    modules = experts_modules(big)
    bodies = {name: harness.loop(hook_bodies(module)) for name, module in modules.items()}
    forwards = {name: harness.loop(forward(module)) for name, module in modules.items()}
    small = small_modules(registers_)
    linears = {name: harness.loop(forward(module, 8)) for name, module in small["linear"].items()}
    pairs = {name: harness.loop(forward(module)) for name, module in small["two weights"].items()}
    plain = (PLAIN, PLAIN_FLOOR)
    cases = [
        case("a. hook bodies called directly", bodies, 10000 // scale, rounds),
        case("b. a real 4-bit forward, 1 thread", forwards, 200 // scale, rounds),
        served(modules, 40 // scale, rounds),
        case("d. the hooks alone on an nn.Linear(8, 8)", linears, 5000 // scale, rounds, against=plain),
        case("e. two quantized 4x64x64 weights, 1 thread", pairs, 1000 // scale, rounds, against=plain),
    ]
    for letter, (width, depth) in zip("fghi", [(64, 1), (64, 2), (256, 1), (256, 2)]):
        blocks = self_calling_modules(registers_, width)
        calls = {name: harness.loop(self_call(block, width, depth)) for name, block in blocks.items()}
        title = f"{letter}. a {width}-wide block calling itself {depth} deep, 2 rows"
        cases.append(case(title, calls, 500 // scale, rounds, against=plain))
    result = {"benchmark": "hotpath", "machine": machine, "cases": cases}
    name = "hotpath-quick" if args.quick else "hotpath"
    harness.write_results(name, result, markdown(result), args.quick, args.output)


if __name__ == "__main__":
    main()
