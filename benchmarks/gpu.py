"""The memory benchmarks on CUDA, in one command (benchmarks/README.md, "CUDA"); options it does not
know go to memory.py (or olmoe_full.py).

python benchmarks/gpu.py --full                         # olmoe_full.py --device cuda, 1 and 16 layers
python benchmarks/gpu.py --full --layers 1 2 4 8 16     # every layer count (more workers)
python benchmarks/gpu.py --full --device cpu            # smoke run: reduced width on the CPU
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import _common as common
import _harness as harness
import memory
import olmoe_full

FULL_LAYERS = ["1", "16"]


def redraw(draw: Callable[[], None]) -> None:
    """Run ``draw`` (one of plot.py's), or say why there is no plot."""
    try:
        draw()
    except ImportError as error:
        print(f"not plotting ({error}); pip install matplotlib, then run benchmarks/plot.py", file=sys.stderr)


def full(device: str, forwarded: list[str], plot_it: bool) -> int:
    """The OLMoE-1B-7B-shaped scenario (olmoe_full.py) on ``device``."""
    smoke = not harness.is_cuda(device)
    arguments = ["--device", device, *forwarded]
    if "--layers" not in forwarded:
        arguments += ["--layers", *FULL_LAYERS]
    if smoke:
        arguments += ["--smoke", "--seq", "32"]
    else:
        arguments += ["--output", str(harness.RESULTS / "olmoe-full-cuda.json")]
    started = time.perf_counter()
    result = olmoe_full.main(arguments)
    assert result is not None
    print(f"OLMoE-1B-7B-shaped benchmark on {device}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if plot_it and not smoke:
        import plot

        redraw(lambda: plot.plot_full(result, harness.DOCS / "memory-olmoe-cuda.png"))
    return 0


def show(result: dict[str, Any]) -> None:
    """Each configuration's CUDA memory after the last step."""
    for config in common.CONFIGS:
        final = result["configs"][config]["final"]
        growth = harness.mib(final["allocated_growth_bytes"])
        print(
            f"{config:>14}: cache {harness.mib(final['cache_bytes'])} held, allocated after last step "
            f"{harness.mib(final['allocated_bytes'])} (grew {growth} since step 1), "
            f"peak {harness.mib(final['max_allocated_bytes'])}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--no-plot", action="store_true", help="do not redraw docs/memory.png")
    parser.add_argument("--full", action="store_true", help="OLMoE-1B-7B's real shapes (olmoe_full.py)")
    args, forwarded = parser.parse_known_args(argv)
    smoke = not harness.is_cuda(args.device)
    if not smoke:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device is available; use --device cpu for a smoke run", file=sys.stderr)
            return 2
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", file=sys.stderr)
    if args.full:
        return full(args.device, forwarded, not args.no_plot)
    output = harness.RESULTS / ("tmp/memory-gpu-smoke.json" if smoke else "memory-cuda.json")
    memory_args = ["--device", args.device, "--output", str(output), *forwarded]
    if smoke and "--quick" not in forwarded:
        memory_args.append("--quick")
    started = time.perf_counter()
    result = memory.main(memory_args)
    assert result is not None
    print(f"memory benchmark on {args.device}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if smoke:
        return 0
    show(result)
    if not args.no_plot:
        import plot

        redraw(
            lambda: plot.plot(
                plot._load(harness.RESULTS / "memory-cpu.json"), result, harness.DOCS / "memory.png"
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
