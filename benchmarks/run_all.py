"""Run every benchmark, one after the other, each in its own interpreter (so the start-up hook and the
``BNB_GC_FIX`` switch behave as they do for users). Never run it beside other work if the timings matter.

    python benchmarks/run_all.py            # memory, hotpath, startup, status_cost: minutes on 2 CPU cores
    python benchmarks/run_all.py --quick    # smoke runs, every script, the GPU ones on the CPU (results/tmp/)
    python benchmarks/run_all.py --gpu      # also gpu.py and olmoe_full.py --device cuda (needs a GPU)
"""

from __future__ import annotations

import subprocess
import sys
import time

import _harness as harness


def commands(quick: bool, gpu: bool) -> list[list[str]]:
    """Every benchmark's command line (script, then options)."""
    if quick:
        return [
            ["memory.py", "--quick"],
            ["hotpath.py", "--quick"],
            ["startup.py", "--quick"],
            ["status_cost.py", "--quick"],
            ["gpu.py", "--device", "cpu"],
            ["olmoe_full.py", "--smoke", "--seq", "32"],
        ]
    found = [["memory.py"], ["hotpath.py"], ["startup.py"], ["status_cost.py"]]
    if gpu:
        found += [["gpu.py"], ["olmoe_full.py", "--device", "cuda"]]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke runs; results go to results/tmp/")
    parser.add_argument("--gpu", action="store_true", help="also the CUDA benchmarks")
    args = parser.parse_args(argv)
    failed = []
    for command in commands(args.quick, args.gpu):
        print(f"\n=== python benchmarks/{' '.join(command)}", flush=True)
        started = time.perf_counter()
        code = subprocess.call(
            [sys.executable, str(harness.HERE / command[0]), *command[1:]], cwd=harness.ROOT
        )
        print(f"=== exit status {code}, {time.perf_counter() - started:.0f} s", flush=True)
        if code:
            failed.append(command[0])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
