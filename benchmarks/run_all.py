"""Run every benchmark, one after the other, with one command; then redraw docs/memory.png.

    python benchmarks/run_all.py            # memory, hotpath, startup, plot: about 10 minutes on 2 CPU cores
    python benchmarks/run_all.py --quick    # smoke run: small sizes, results in results/tmp/
    python benchmarks/run_all.py --gpu      # also the CUDA memory benchmark (needs a GPU)
    python benchmarks/run_all.py --full     # also one layer at OLMoE-1B-7B's real width (olmoe_full.py)
    python benchmarks/run_all.py --only hotpath startup

Each benchmark runs in its own interpreter, so the start-up hook and the ``BNB_GC_FIX`` switch behave as
they do for users. Never run it beside other work if the timings matter.
"""

from __future__ import annotations

import subprocess
import sys
import time

import _harness as harness

BENCHMARKS = ("memory", "hotpath", "startup", "gpu", "plot", "olmoe-full")
TMP = harness.RESULTS / "tmp"


def commands(quick: bool, gpu: bool, full: bool) -> dict[str, list[str]]:
    """Every benchmark's command line (script, then options); quick ones write to results/tmp/."""
    quick_flag = ["--quick"] if quick else []
    quick_plot = ["--cpu", str(TMP / "memory-cpu-quick.json"), "--output", str(TMP / "memory.png")]
    found = {
        "memory": ["memory.py", *quick_flag],
        "hotpath": ["hotpath.py", *quick_flag],
        "startup": ["startup.py", *quick_flag],
        "gpu": ["gpu.py", "--no-plot", *quick_flag],
        "plot": ["plot.py", *(quick_plot if quick else [])],
        "olmoe-full": ["olmoe_full.py", *(["--smoke", "--seq", "32"] if quick else [])],
    }
    if not gpu:
        del found["gpu"]
    if not full:
        del found["olmoe-full"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run; results go to results/tmp/")
    parser.add_argument("--gpu", action="store_true", help="also run gpu.py (CUDA memory benchmark)")
    parser.add_argument("--full", action="store_true", help="also olmoe_full.py (one OLMoE-1B-7B layer)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these")
    args = parser.parse_args(argv)
    failures = []
    for name, command in commands(args.quick, args.gpu, args.full).items():
        if args.only and name not in args.only:
            continue
        print(f"\n=== {name}: python benchmarks/{' '.join(command)}", flush=True)
        started = time.perf_counter()
        code = subprocess.call(
            [sys.executable, str(harness.HERE / command[0]), *command[1:]], cwd=harness.ROOT
        )
        print(f"=== {name}: exit status {code}, {time.perf_counter() - started:.0f} s", flush=True)
        if code:
            failures.append(name)
    if failures:
        print(f"failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
