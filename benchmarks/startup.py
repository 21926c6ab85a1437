"""Start-up benchmark: what the start-up hook costs at interpreter start beside setuptools' own
``_distutils_hack``, both read from the same ``python -X importtime -c pass`` runs, in venvs made from the
wheel; the hook's .pth file as shipped (sorting after setuptools' ``distutils-precedence.pth``) and
renamed to sort first, and an empty module imported from a .pth file in the shipped place as the floor
(benchmarks/README.md, "Start-up").

    python benchmarks/startup.py            # 100 rounds: results/startup.md
    python benchmarks/startup.py --quick    # 20 rounds (results/tmp/)
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _harness as harness

HOOK = "_bnb_gc_fix"  # the module the shipped .pth file imports
HACK = "_distutils_hack"  # the module setuptools' distutils-precedence.pth imports
FLOOR = "_empty_start_up_module"  # an empty module, imported from a .pth file in the hook's place
SHIPPED_PTH = "zz_bnb_gc_fix.pth"  # sorts after distutils-precedence.pth
FIRST_PTH = "bnb_gc_fix.pth"  # sorts before it
#: The venvs: (.pth file name, the module it imports).
VENVS = {
    "hook, as shipped (after setuptools')": (SHIPPED_PTH, HOOK),
    "hook, renamed to sort first": (FIRST_PTH, HOOK),
    "empty module, as shipped": (SHIPPED_PTH, FLOOR),
}
SHIPPED, RENAMED, EMPTY = VENVS
PROBE = "import sys; print([type(f).__module__ for f in sys.meta_path].count('_bnb_gc_fix'))"


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=True, text=True, capture_output=True, **kwargs)


def clean_env() -> dict[str, str]:
    dropped = ("PYTHON", "BNB_GC_FIX", "VIRTUAL_ENV")
    return {key: value for key, value in os.environ.items() if not key.startswith(dropped)}


def build_wheel(folder: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(folder), str(harness.ROOT)])
    [wheel] = sorted(folder.glob("bnb_gc_fix-*.whl"))
    return wheel


def site_packages(venv: Path) -> Path:
    [found] = (venv / "lib").glob("python*/site-packages")
    return found


def shipped_venv(venv: Path, wheel: Path) -> None:
    """A venv with the running environment's setuptools and the wheel (``--no-deps``: wrapt and packaging
    are imported only once bitsandbytes is, never at start)."""
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps"]
    _run([*pip, f"setuptools=={version('setuptools')}", str(wheel)])


def variant(shipped: Path, venv: Path, pth: str, module: str) -> None:
    """A copy of the shipped venv whose hook .pth file is named ``pth`` and imports ``module``."""
    shutil.copytree(shipped, venv, symlinks=True)
    folder = site_packages(venv)
    line = (folder / SHIPPED_PTH).read_text()
    (folder / SHIPPED_PTH).unlink()
    if module == FLOOR:
        (folder / f"{FLOOR}.py").write_text("")
        _run([str(venv / "bin" / "python"), "-m", "py_compile", str(folder / f"{FLOOR}.py")])
        line = f"import {FLOOR}\n"
    (folder / pth).write_text(line)


def cumulative_us(importtime: str, name: str) -> int:
    """The cumulative import time (µs) of the module ``name`` in ``-X importtime`` output (what it
    imports counts too); 0 if it was not imported."""
    for line in importtime.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[2].strip() == name:
            return int(parts[1])
    return 0


def one_run(venv: Path, module: str) -> dict[str, int]:
    """One ``python -X importtime -c pass``: the hook module's and ``_distutils_hack``'s cumulative µs."""
    command = [str(venv / "bin" / "python"), "-X", "importtime", "-c", "pass"]
    stderr = _run(command, env=clean_env()).stderr
    return {"hook_us": cumulative_us(stderr, module), "hack_us": cumulative_us(stderr, HACK)}


def check(venv: Path, module: str, first: bool) -> None:
    """Both modules imported at start, in the expected order; the hook's watcher on sys.meta_path."""
    command = [str(venv / "bin" / "python"), "-X", "importtime", "-c", PROBE]
    run = _run(command, env=clean_env())
    names = [line.split("|")[-1].strip() for line in run.stderr.splitlines()]
    if module not in names or HACK not in names:
        raise SystemExit(f"{venv.name}: {module} or {HACK} was not imported at start")
    if (names.index(module) < names.index(HACK)) is not first:
        raise SystemExit(f"{venv.name}: {module} was not imported {'first' if first else 'second'}")
    if run.stdout.strip() != ("1" if module == HOOK else "0"):
        raise SystemExit(f"{venv.name}: {run.stdout.strip()} watchers on sys.meta_path")


def venvs(folder: Path) -> dict[str, Path]:
    """Every venv of ``VENVS``, checked."""
    print(f"building the wheel and {len(VENVS)} venvs in {folder}", file=sys.stderr)
    wheel = build_wheel(folder / "dist")
    made = {name: folder / f"venv-{index}" for index, name in enumerate(VENVS)}
    shipped_venv(made[SHIPPED], wheel)
    for name, (pth, module) in VENVS.items():
        if name != SHIPPED:
            variant(made[SHIPPED], made[name], pth, module)
        check(made[name], module, first=pth < "distutils-precedence.pth")
    return made


def _spread(values: list[float]) -> dict[str, float]:
    return harness.Spread.of(values).record()


def summary(runs: list[dict[str, int]]) -> dict[str, Any]:
    """One venv's runs: the hook module's and _distutils_hack's µs, their sum, and the ratio of their
    medians (the figure the maintainers' start-up cost tool reads)."""
    hook = [float(run["hook_us"]) for run in runs]
    hack = [float(run["hack_us"]) for run in runs]
    return {
        "hook_us": _spread(hook),
        "hack_us": _spread(hack),
        "both_us": _spread(_both(runs)),
        "ratio_of_medians": statistics.median(hook) / statistics.median(hack),
    }


def _both(runs: list[dict[str, int]]) -> list[float]:
    return [float(run["hook_us"] + run["hack_us"]) for run in runs]


def against(ours: list[float], other: list[float]) -> dict[str, Any]:
    """One side against another, round by round: the difference in µs and the ratio, and what the ratio
    reads as (with no floor of its own: 1 inside its interquartile range or not)."""
    ratio = harness.Spread.of(harness.ratios(ours, other))
    return {
        "difference_us": _spread([a - b for a, b in zip(ours, other)]),
        "ratio": ratio.record(),
        "result": harness.verdict(ratio, floor=None),
    }


def comparisons(runs: dict[str, list[dict[str, int]]]) -> dict[str, Any]:
    """The hook's module against the empty one in its place, and both .pth files' modules together
    as shipped against the hook sorting first (who lists site-packages moves; does the sum?)."""

    def hook(name: str) -> list[float]:
        return [float(run["hook_us"]) for run in runs[name]]

    return {
        "hook over the empty module, both after setuptools'": against(hook(SHIPPED), hook(EMPTY)),
        "hook + _distutils_hack, as shipped over the hook first": against(
            _both(runs[SHIPPED]), _both(runs[RENAMED])
        ),
    }


def markdown(result: dict[str, Any]) -> str:
    rows = []
    for name, figures in result["venvs"].items():
        rows.append(
            [
                name,
                harness.Spread(**figures["hook_us"]).text(" µs", 0),
                harness.Spread(**figures["hack_us"]).text(" µs", 0),
                harness.Spread(**figures["both_us"]).text(" µs", 0),
                f"{figures['ratio_of_medians']:.2f}x",
            ]
        )
    header = ["venv", "its module", HACK, "both", f"its module / {HACK}, ratio of medians"]
    lines = [
        f"`python -X importtime -c pass`, {result['rounds']} rounds of the {len(rows)} venvs, order "
        "alternating; cumulative import times, median (interquartile range).",
        "",
        *harness.table(header, rows),
        "",
    ]
    for name, comparison in result["comparisons"].items():
        difference = harness.Spread(**comparison["difference_us"]).text(" µs", 0)
        ratio = harness.Spread(**comparison["ratio"]).text("x", 2)
        lines.append(f"- {name}: {difference}; {ratio}: **{comparison['result']}**.")
    lines += ["", harness.machine_line(result["machine"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="20 rounds")
    parser.add_argument("--output", type=Path, help="the raw JSON (its .md beside it)")
    args = parser.parse_args(argv)
    rounds = 20 if args.quick else args.rounds
    machine = harness.machine()  # the load as it started, before the venvs are made
    with tempfile.TemporaryDirectory(prefix="bnb-gc-fix-startup-") as folder:
        made = venvs(Path(folder))
        sides = {name: partial(one_run, made[name], VENVS[name][1]) for name in VENVS}
        harness.alternate(sides, 3)  # warm-up
        print(f"timing {rounds} rounds of `python -X importtime -c pass`", file=sys.stderr)
        runs = harness.alternate(sides, rounds)
    result: dict[str, Any] = {
        "benchmark": "startup",
        "machine": machine,
        "rounds": rounds,
        "venvs": {name: summary(found) for name, found in runs.items()},
        "comparisons": comparisons(runs),
        "runs": runs,
    }
    name = "startup-quick" if args.quick else "startup"
    harness.write_results(name, result, markdown(result), args.quick, args.output)


if __name__ == "__main__":
    main()
