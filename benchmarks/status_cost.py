"""What a call of ``bnb_gc_fix.status()`` costs in a large process: 400,000 objects alive beside a few
quantized modules, after a step. Three processes, each fresh: the fix turned on by the start-up hook; a
late import (the process started with ``BNB_GC_FIX=0``, bitsandbytes' 4-bit module imported and the modules
quantized first, then ``activate()``); and the fix off, where ``status()`` has nothing to look the modules
up in and reads every object (benchmarks/README.md, "status()").

    python benchmarks/status_cost.py            # 5 processes a case, 50 calls each: results/status_cost.md
    python benchmarks/status_cost.py --quick    # 1 process a case (results/tmp/)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import _harness as harness

OBJECTS = 400_000
MODULES = 3
CASES = {  # each case's BNB_GC_FIX at the start, and whether the worker calls activate() late
    "the start-up hook": (None, False),
    "a late import, then activate()": ("0", True),
    "the fix off (BNB_GC_FIX=0)": ("0", False),
}


def worker(late: bool, calls: int) -> None:
    """In a fresh process: the objects, the modules, a step, then ``calls`` timed status() calls."""
    import time

    import torch

    sys.path.insert(0, str(harness.ROOT / "tests" / "scenarios"))
    import quantized

    alive = [{"object": index} for index in range(OBJECTS)]  # tracked by the collector, as a model's are
    modules = [quantized.make(params=2) for _ in range(MODULES)]
    if late:
        os.environ["BNB_GC_FIX"] = "auto"
    import bnb_gc_fix

    if late:
        bnb_gc_fix.activate()
    for module in modules:
        module(torch.randn(2, 64))
    state = bnb_gc_fix.status().state
    timings = []
    for _ in range(calls):
        started = time.perf_counter_ns()
        bnb_gc_fix.status()
        timings.append(time.perf_counter_ns() - started)
    print(json.dumps({"state": state, "ns": timings, "objects": len(alive)}))


def run_case(switch: str | None, late: bool, calls: int) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key != "BNB_GC_FIX"}
    if switch is not None:
        env["BNB_GC_FIX"] = switch
    env["PYTHONWARNINGS"] = "ignore"
    command = [sys.executable, __file__, "--worker", "--calls", str(calls)] + (["--late"] if late else [])
    done = subprocess.run(command, env=env, cwd=harness.ROOT, text=True, capture_output=True, check=True)
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def markdown(result: dict[str, Any]) -> str:
    header = ["case", "state", "status() per call: median (interquartile range)", "calls"]
    rows = []
    for name, found in result["cases"].items():
        spread = harness.Spread.of(found["ns"])
        rows.append(
            [
                name,
                found["state"],
                spread.text(unit=" ms", scale=1e6),
                str(len(found["ns"])),
            ]
        )
    preamble = (
        f"{OBJECTS:,} objects alive, {MODULES} modules of two 4-bit weights, after a step; every call "
        "of every process, each case's processes alternating."
    )
    return harness.page(preamble, header, rows, result["machine"])


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="1 process a case")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a case's own process
    parser.add_argument("--late", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, help="the raw JSON (its .md beside it)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.late, args.calls)
        return
    processes = 1 if args.quick else args.processes
    runs = harness.alternate(
        {name: lambda case=case: run_case(*case, args.calls) for name, case in CASES.items()}, processes
    )
    cases = {
        name: {"state": found[0]["state"], "ns": [ns for each in found for ns in each["ns"]]}
        for name, found in runs.items()
    }
    medians = {name: statistics.median(found["ns"]) for name, found in cases.items()}
    result = {"benchmark": "status_cost", "machine": harness.machine(), "cases": cases, "medians": medians}
    name = "status_cost-quick" if args.quick else "status_cost"
    harness.write_results(name, result, markdown(result), args.quick, args.output)


if __name__ == "__main__":
    main()
