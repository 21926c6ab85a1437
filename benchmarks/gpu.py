"""The memory benchmark on CUDA (benchmarks/README.md, "CUDA"): ``memory.py --device cuda``, which records
``memory_allocated`` and ``max_memory_allocated`` per step, then docs/memory.png redrawn with its panels.
Options it does not know go to memory.py. (The full size on a GPU: ``olmoe_full.py --device cuda``.)

    python benchmarks/gpu.py                   # results/memory-cuda.json and .md, docs/memory.png
    python benchmarks/gpu.py --device cpu      # smoke run without a GPU (quick sizes, results/tmp/)
"""

from __future__ import annotations

import sys
from typing import Any

import _harness as harness
import memory


def show(result: dict[str, Any]) -> None:
    """Each configuration's CUDA memory after the last step."""
    for config in harness.CONFIGS:
        final = result["configs"][config]["final"]
        print(
            f"{config:>14}: cache {harness.mib(final['cache_bytes'])} held, allocated after last step "
            f"{harness.mib(final['allocated_bytes'])} (grew {harness.mib(final['allocated_growth_bytes'])} "
            f"since step 1), peak {harness.mib(final['max_allocated_bytes'])}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--no-plot", action="store_true", help="do not redraw docs/memory.png")
    args, forwarded = parser.parse_known_args(argv)
    cuda = harness.is_cuda(args.device)
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device is available; use --device cpu for a smoke run", file=sys.stderr)
            return 2
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", file=sys.stderr)
    output = harness.RESULTS / ("memory-cuda.json" if cuda else "tmp/memory-gpu-smoke.json")
    memory_args = ["--device", args.device, "--output", str(output), *forwarded]
    if not cuda and "--quick" not in forwarded:
        memory_args.append("--quick")
    result = memory.main(memory_args)
    assert result is not None
    if not cuda:
        return 0
    show(result)
    if not args.no_plot:
        import plot

        plot.plot(plot._load(harness.RESULTS / "memory-cpu.json"), result, harness.DOCS / "memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
