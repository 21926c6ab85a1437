"""Start-up benchmark: what the ``bnb_gc_fix.pth`` hook adds to ``python -c pass``, in two venvs made alike
but for the wheel, timed in alternating pairs (method and why two venvs: benchmarks/README.md, "Start-up").

    python benchmarks/startup.py              # 100 pairs; writes results/startup.json
    python benchmarks/startup.py --pairs 30
    python benchmarks/startup.py --variants   # also time candidate changes to the hook
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import _harness as harness

PROBE = "import sys; print(any(getattr(f, 'bnb_gc_fix_watcher', False) for f in sys.meta_path))"


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=True, text=True, capture_output=True, **kwargs)


def build_wheel(outdir: Path) -> Path:
    try:
        _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(harness.ROOT)])
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        print(f"python -m build failed ({error}); trying pip wheel", file=sys.stderr)
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(outdir), str(harness.ROOT)])
    wheels = sorted(outdir.glob("bnb_gc_fix-*.whl"))
    if not wheels:
        raise SystemExit(f"no wheel was built in {outdir}")
    return wheels[-1]


def make_venv(path: Path, wheel: Path | None) -> Path:
    """A venv with wrapt and packaging at the running environment's versions, and ``wheel`` if given."""
    _run([sys.executable, "-m", "venv", str(path)])
    python = path / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, f"wrapt=={version('wrapt')}", f"packaging=={version('packaging')}"])
    if wheel is not None:
        _run([*pip, "--no-deps", str(wheel)])
    return python


def clean_env() -> dict[str, str]:
    dropped = ("PYTHON", "BNB_GC_FIX", "VIRTUAL_ENV")
    return {key: value for key, value in os.environ.items() if not key.startswith(dropped)}


def time_once(python: Path, env: dict[str, str]) -> tuple[float, float]:
    """One ``python -c pass``: (wall ms, the child's CPU ms, user + system)."""
    started = time.perf_counter_ns()
    process = subprocess.Popen([str(python), "-c", "pass"], env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = (time.perf_counter_ns() - started) / 1e6
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{python} -c pass failed with status {process.returncode}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1e3


def _summary(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Medians of the ``kind`` (wall or cpu) times with and without the package, and of the pairs' ratios."""
    with_ms = [row[f"with_{kind}_ms"] for row in rows]
    without_ms = [row[f"without_{kind}_ms"] for row in rows]
    ratio = harness.Spread.of(harness.ratios(with_ms, without_ms))
    return {
        "median_with_ms": harness.median(with_ms),
        "median_without_ms": harness.median(without_ms),
        "median_difference_ms": harness.median([a - b for a, b in zip(with_ms, without_ms)]),
        "ratio": ratio.record(),
        "result": harness.verdict(ratio, floor=None),
    }


def _pair(index: int, with_package: tuple[float, float], without: tuple[float, float]) -> dict[str, Any]:
    """One pair's record: its wall and CPU times, and which side ran first."""
    return {
        "with_wall_ms": with_package[0],
        "without_wall_ms": without[0],
        "with_cpu_ms": with_package[1],
        "without_cpu_ms": without[1],
        "first": harness.order_of(["with", "without"], index)[0],
    }


def measure(with_package: Path, without: Path, pairs: int, warmup: int) -> dict[str, Any]:
    env = clean_env()
    sides = {"with": lambda: time_once(with_package, env), "without": lambda: time_once(without, env)}
    harness.alternate(sides, warmup)
    timed = harness.alternate(sides, pairs)
    rows = [_pair(index, *pair) for index, pair in enumerate(zip(timed["with"], timed["without"]))]
    wall = _summary(rows, "wall")
    return {
        "pairs": pairs,
        "warmup_pairs": warmup,
        "wall": wall,
        "cpu": _summary(rows, "cpu"),
        "goal": "wall-clock ratio <= 1.05",
        "met": wall["ratio"]["median"] <= 1.05,
        "runs": rows,
    }


SITE_PACKAGES = Path("lib") / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _variant(source: Path, target: Path, pth: str) -> Path:
    """A copy of the venv with the package, with another ``.pth`` line (measurement only)."""
    shutil.copytree(source, target, symlinks=True)
    site_packages = target / SITE_PACKAGES
    (site_packages / "bnb_gc_fix.pth").write_text(pth + "\n")
    for cached in (site_packages / "_bnb_gc_fix" / "__pycache__").glob("startup.*"):
        cached.unlink()
    return target / "bin" / "python"


#: Candidate changes to the start-up hook, measured with --variants (the package is not changed).
VARIANTS: dict[str, str] = {
    "a plain `import _bnb_gc_fix.startup; _bnb_gc_fix.startup.install_quietly()` .pth line (not silent "
    "when the package is missing)": "import _bnb_gc_fix.startup; _bnb_gc_fix.startup.install_quietly()",
    "the .pth file alone (`import sys`), no start-up module: the floor of any .pth hook": "import sys",
}


def venvs(workdir: Path) -> tuple[str, Path, Path]:
    """The wheel's name, the venv with it and the one without; the hook checked live in the first only."""
    print(f"building the wheel and two venvs in {workdir}", file=sys.stderr)
    wheel = build_wheel(workdir / "dist")
    with_package = make_venv(workdir / "with", wheel)
    without = make_venv(workdir / "without", None)
    live = _run([str(with_package), "-c", PROBE], env=clean_env()).stdout.strip()
    absent = _run([str(without), "-c", PROBE], env=clean_env()).stdout.strip()
    if (live, absent) != ("True", "False"):
        raise SystemExit(f"the start-up hook is not where it should be: with={live} without={absent}")
    return wheel.name, with_package, without


def show(measured: dict[str, Any], variants: dict[str, Any]) -> None:
    for kind in ("wall", "cpu"):
        figures = measured[kind]
        ratio = harness.Spread(**figures["ratio"]).text()
        print(
            f"python -c pass, {kind}: {figures['median_with_ms']:.2f} ms with the package, "
            f"{figures['median_without_ms']:.2f} ms without, "
            f"difference {figures['median_difference_ms']:.2f} ms; "
            f"ratio {ratio} (median of {measured['pairs']} pairs): {figures['result']}"
        )
    print(f"goal {measured['goal']}: {'met' if measured['met'] else 'NOT met'}")
    for name, figures in variants.items():
        print(
            f"variant, {name}: difference {figures['cpu']['median_difference_ms']:.2f} ms CPU, "
            f"ratio {figures['wall']['ratio']['median']:.3f} wall, "
            f"{figures['cpu']['ratio']['median']:.3f} CPU"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__)
    parser.add_argument("--pairs", type=int, default=100, help="paired runs (at least 30; default 100)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--variants", action="store_true", help="also time candidate changes to the hook")
    args = parser.parse_args(argv)
    if args.pairs < 30:
        parser.error("--pairs must be at least 30")
    started = time.perf_counter()
    variants: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bnb-gc-fix-startup-") as folder:
        workdir = Path(folder)
        wheel, with_package, without = venvs(workdir)
        print(f"timing {args.pairs} pairs of `python -c pass`", file=sys.stderr)
        measured = measure(with_package, without, args.pairs, args.warmup)
        for index, (name, pth) in enumerate(VARIANTS.items() if args.variants else ()):
            python = _variant(workdir / "with", workdir / f"variant-{index}", pth)
            print(f"timing {args.pairs} pairs: {name}", file=sys.stderr)
            figures = measure(python, without, args.pairs, args.warmup)
            variants[name] = {kind: figures[kind] for kind in ("wall", "cpu")}
    result: dict[str, Any] = {
        "benchmark": "startup",
        "machine": harness.machine(),
        "command": "python -c pass",
        "wheel": wheel,
        "environments": (
            "two venvs made by `python -m venv` from the same interpreter, both with wrapt and "
            "packaging pinned to the running environment's versions; the wheel installed "
            "--no-deps into one only"
        ),
        "hook_live_with_package": True,
        "method": (
            "paired runs, order alternating every pair, after warm-up; ratio = median of pair ratios; "
            "wall = perf_counter around spawn+wait, cpu = the child's user+system time (os.wait4), "
            "less sensitive to other load on the machine"
        ),
        **measured,
        "variants": variants,
        "wall_s": time.perf_counter() - started,
    }
    harness.write_json(args.output or harness.RESULTS / "startup.json", result)
    show(measured, variants)
    return result


if __name__ == "__main__":
    main()
