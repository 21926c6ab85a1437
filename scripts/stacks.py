"""Stack cells: the package's core scenarios on other interpreters and torch builds.

    python scripts/stacks.py                     # every cell; writes docs/stack-matrix.json
    python scripts/stacks.py --only oldest --no-write
    python scripts/stacks.py --list

Each cell is one line of ``STACKS``: an interpreter (pyenv's ``3.X``, else ``python3.X`` on ``PATH``) and the
pins of its own venv. The runner makes that venv, installs bnb-gc-fix into it (editable, no
dependencies) and runs ``python -m pytest -m stack`` there: the tests marked ``stack`` (leak and
control, Ctrl-C heal, threads, torchrun with 2 ranks, the Trainer callback, ``check``,
``status``) take their expectations from the installed versions, so the same tests run on every cell.

Torch builds other than the CPU wheel on this machine's disk are PyPI's CUDA builds (they run on
the CPU, but need their ``nvidia-*`` wheels, about 3 GB a torch). Everything is kept outside the work
tree, in ``$BNB_GC_FIX_STACKS_CACHE`` (default ``~/.cache/bnb-gc-fix-stacks``): ``wheels/`` (``pip
download`` skips what is already there) and ``venvs/<cell>`` (reused while its pins are unchanged),
so a second run downloads and installs nothing. A cell's torch pin replaces the machine-wide pip
constraint for that cell's commands only (``PIP_CONSTRAINT`` pointing at a file of our own).
Exit status: 0 every cell passed, 1 some cell failed, 2 a cell could not be set up.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import tomllib  # the runner needs Python >= 3.11; the cells do not

REPO = Path(__file__).resolve().parent.parent
# Every cell also gets the package's own dependencies, test tools, and what an editable build needs.
COMMON = (
    *tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"],
    *("accelerate>=1.1", "pytest>=7", "hatchling>=1.24", "editables"),
)


@dataclasses.dataclass(frozen=True)
class Stack:
    name: str
    python: str  # "3.9": a pyenv 3.9.x, else python3.9 on PATH
    pins: str  # pip requirements, space-separated, torch first
    extra_tests: str = ""  # files in tests/ (space-separated) run whole as well, where they exist


# One line a stack. oldest: the oldest torch and Python that bitsandbytes 0.48 accepts (transformers 4.x:
# per-expert Linears, reentrant by default); newest: the newest torch PyPI serves for the newest Python,
# with an affected and an upstream-fixed bitsandbytes. The reference stack (Python 3.11, torch 2.13.0
# CPU) is the main test run itself.
STACKS = [
    Stack("oldest", "3.9", "torch==2.3.1 numpy<2 bitsandbytes==0.48.0 transformers==4.57.6"),
    Stack("newest", "3.13", "torch==2.15.0 bitsandbytes==0.49.2 transformers==5.13.1", "test_axolotl.py"),
    Stack("newest-0.50", "3.13", "torch==2.15.0 bitsandbytes==0.50.2 transformers==5.13.1"),
]


def log(message: str) -> None:
    print(f"[stacks {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class SetupError(Exception):
    pass


def interpreter(version: str) -> str:
    pyenv = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    # pyenv first: its shim on PATH answers python3.X only for the versions pyenv has selected
    found = pyenv[-1] if pyenv else shutil.which(f"python{version}")
    if found is None:
        raise SetupError(f"no python{version} on PATH or in ~/.pyenv/versions")
    return found


def sh(command: list[str], env: dict[str, str] | None = None, timeout: int = 1800) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if done.returncode != 0:
        raise SetupError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout


def prepare(stack: Stack, cache: Path) -> Path:
    """The cell's venv, made (or reused while its pins are unchanged); returns its python."""
    venv, wheels = cache / "venvs" / stack.name, cache / "wheels"
    python = venv / "bin" / "python"
    pins = [*stack.pins.split(), *COMMON]
    stamp = json.dumps({"python": stack.python, "pins": pins})
    if not (python.exists() and (venv / ".stack-ok").exists() and (venv / ".stack-ok").read_text() == stamp):
        shutil.rmtree(venv, ignore_errors=True)
        wheels.mkdir(parents=True, exist_ok=True)
        base = interpreter(stack.python)
        log(f"{stack.name}: making {venv} with {base}; downloading into {wheels} what is missing")
        sh([base, "-m", "venv", str(venv)])
        constraint = venv / "torch-constraint.txt"  # replaces the machine-wide torch cap, for this cell
        constraint.write_text(pins[0] + "\n")
        env = dict(os.environ, PIP_CONSTRAINT=str(constraint), PIP_DISABLE_PIP_VERSION_CHECK="1")
        sh([str(python), "-m", "pip", "download", "-q", "-d", str(wheels), *pins], env=env)
        sh([str(python), "-m", "pip", "install", "-q", "--no-index", "-f", str(wheels), *pins], env=env)
        (venv / ".stack-ok").write_text(stamp)
    # Every run: this checkout, editable (the start-up .pth included), without touching the pins.
    sh([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(REPO)])
    return python


VERSIONS = (
    "import json, platform; from importlib import metadata as m; d = {'python': platform.python_version()}\n"
    "for n in ('torch', 'bitsandbytes', 'transformers'): d[n] = m.version(n)\n"
    "print(json.dumps(d))"
)


def junit(path: Path) -> list[dict[str, Any]]:
    tests = []
    for case in ET.parse(path).iter("testcase"):
        outcome = "passed"
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(child) is not None:
                outcome = name
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0), 1),
                **properties,
            }
        )
    return tests


def run_stack(stack: Stack, cache: Path) -> dict[str, Any]:
    started = time.monotonic()
    python = prepare(stack, cache)
    setup = round(time.monotonic() - started, 1)
    row: dict[str, Any] = {"cell": stack.name, "pins": stack.pins.split(), "setup_seconds": setup}
    row.update(json.loads(sh([str(python), "-c", VERSIONS])))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BNB_GC_FIX", "VIRTUAL_ENV")}
    runs = [["-m", "stack", "tests"]]
    runs += [[f"tests/{name}"] for name in stack.extra_tests.split() if (REPO / "tests" / name).exists()]
    tests, tails = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for index, selection in enumerate(runs):
            report = Path(tmp) / f"junit{index}.xml"
            command = [
                str(python),
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-o",
                "junit_family=xunit1",  # keeps the tests' record_property (counters) without a warning
                f"--junitxml={report}",
                *selection,
            ]
            log(f"{stack.name}: {' '.join(command[1:])}")
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
            tails.append(done.stdout[-3000:])
            tests += junit(report) if report.exists() else [{"test": str(selection), "outcome": "error"}]
    row["tests"] = tests
    row["test_seconds"] = round(time.monotonic() - started - setup, 1)
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    row["counts"] = counts
    row["verdict"] = "PASS" if counts["passed"] and not counts["failed"] + counts["error"] else "FAIL"
    if row["verdict"] != "PASS":
        row["output_tail"] = tails
    log(f"{stack.name}: {row['verdict']} {counts} (setup {setup} s, tests {row['test_seconds']} s)")
    return row


def default_cache() -> Path:
    if os.environ.get("BNB_GC_FIX_STACKS_CACHE"):
        return Path(os.environ["BNB_GC_FIX_STACKS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bnb-gc-fix-stacks"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cache-dir", type=Path, default=default_cache(), help="default: %(default)s")
    parser.add_argument("--only", nargs="+", metavar="CELL", choices=[s.name for s in STACKS])
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/stack-matrix.json")
    parser.add_argument("--output", type=Path, default=REPO / "docs" / "stack-matrix.json")
    args = parser.parse_args(argv)
    if args.list:
        for stack in STACKS:
            print(f"{stack.name:14} python{stack.python:5} {stack.pins}")
        return 0
    started = time.monotonic()
    rows = []
    try:
        for stack in STACKS:
            if not args.only or stack.name in args.only:
                rows.append(run_stack(stack, args.cache_dir.resolve()))
    except (SetupError, subprocess.TimeoutExpired, OSError) as error:
        print(f"stacks: cannot set up: {error}", file=sys.stderr)
        return 2
    seconds = round(time.monotonic() - started, 1)
    for row in rows:
        print(
            f"{row['cell']:14} {row['verdict']}  Python {row['python']}, torch {row['torch']}, "
            f"bitsandbytes {row['bitsandbytes']}, transformers {row['transformers']}: {row['counts']}; "
            f"setup {row['setup_seconds']} s, tests {row['test_seconds']} s"
        )
    if not args.only and not args.no_write:
        generated = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        payload = {
            "generated_by": "python scripts/stacks.py",
            "generated": generated,
            "seconds": seconds,
            "cells": rows,
        }
        args.output.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.output}")
    failed = [row["cell"] for row in rows if row["verdict"] != "PASS"]
    print(
        f"stacks: {len(rows) - len(failed)}/{len(rows)} cells PASS in {seconds:.0f} s"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
