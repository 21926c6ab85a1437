"""Build bnb-gc-fix's sdist and wheel, inspect the wheel, and prove it works from a fresh venv.

    python scripts/wheel_check.py [--keep] [--steps 3]

Standard library only. Steps:

1. ``python -m build`` (installed first if missing) builds the sdist and, from it, the wheel
   into a temporary folder.
2. The wheel must hold ``bnb_gc_fix.pth`` at its root (byte-identical to the repo's),
   ``_bnb_gc_fix_boot.py``, ``bnb_gc_fix/py.typed``, the ``bnb-gc-fix`` console script, the
   pytest plugin (``bnb_gc_fix_pytest.py`` and its ``pytest11`` entry point), and
   declare exactly wrapt and packaging as its unconditional runtime requirements.
3. A fresh ``python -m venv`` gets ``torch==2.13.0``, then ``bitsandbytes==0.49.2
   transformers==5.13.1`` (both with ``-c constraints.txt``), then the wheel.
4. ``tests/scenarios/tiny_olmoe.py``, copied out of the repo and never importing bnb_gc_fix
   itself, trains for a few steps there: with ``BNB_GC_FIX`` unset the start-up hook must keep the
   cache counter at 0 after every step; with ``BNB_GC_FIX=0`` it must leak.
5. ``bnb-gc-fix status --json`` from that venv must report the fix active on bitsandbytes 0.49.2.

Prints one PASS/FAIL line per check; exit 0 all passed, 1 a check failed, 2 it could not run.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "constraints.txt"
SCENARIO = REPO / "tests" / "scenarios" / "tiny_olmoe.py"
TORCH = "torch==2.13.0"
STACK = ["bitsandbytes==0.49.2", "transformers==5.13.1"]
RUNTIME_DEPS = {"wrapt", "packaging"}
CONSOLE_SCRIPT = ("bnb-gc-fix", "bnb_gc_fix.cli:main")


class CannotRunError(Exception):
    """A build or install step failed: the check could not be carried out."""


class Checks:
    def __init__(self) -> None:
        self.results: list[tuple[bool, str, str]] = []

    def add(self, ok: bool, name: str, detail: str = "") -> bool:
        self.results.append((ok, name, detail))
        print(f"  {'PASS' if ok else 'FAIL'}  {name}{f': {detail}' if detail else ''}", flush=True)
        return ok

    @property
    def failed(self) -> list[str]:
        return [name for ok, name, _ in self.results if not ok]


def log(message: str) -> None:
    print(f"[wheel-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run a set-up step; raise CannotRunError with its output tail when it fails."""
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    log(
        f"{' '.join(Path(c).name if os.sep in c else c for c in command[:6])} ... "
        f"rc={done.returncode} in {time.monotonic() - started:.0f}s"
    )
    if done.returncode != 0:
        raise CannotRunError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def clean_env() -> dict[str, str]:
    """The caller's environment minus anything that could let the repo or the switch leak in."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "BNB_GC_FIX", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


# --------------------------------------------------------------------------- build and inspect


def build(outdir: Path) -> tuple[Path, Path]:
    try:
        import build  # noqa: F401
    except ImportError:
        log("installing build")
        run([sys.executable, "-m", "pip", "install", "--quiet", "build"])
    run([sys.executable, "-m", "build", "--outdir", str(outdir), str(REPO)])
    wheels, sdists = sorted(outdir.glob("*.whl")), sorted(outdir.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise CannotRunError(f"expected one wheel and one sdist in {outdir}, found {wheels + sdists}")
    return wheels[0], sdists[0]


def unconditional_requirements(metadata: str) -> set[str]:
    """Requires-Dist names without an environment marker (extras carry ``extra == ...`` markers)."""
    message = email.parser.Parser().parsestr(metadata)
    names = set()
    for requirement in message.get_all("Requires-Dist") or []:
        if ";" in requirement:
            continue
        match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if match:
            names.add(re.sub(r"[-_.]+", "-", match.group(1)).lower())
    return names


def inspect_wheel(wheel: Path, sdist: Path, checks: Checks) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
        checks.add(len(dist_info) == 1, "wheel has one .dist-info", ", ".join(dist_info))
        info = dist_info[0] if dist_info else ""
        has_pth = "bnb_gc_fix.pth" in names
        checks.add(has_pth, "bnb_gc_fix.pth at the wheel root")
        if has_pth:
            same = archive.read("bnb_gc_fix.pth") == (REPO / "bnb_gc_fix.pth").read_bytes()
            checks.add(same, "bnb_gc_fix.pth is the repo's file byte for byte")
        checks.add("_bnb_gc_fix_boot.py" in names, "_bnb_gc_fix_boot.py at the wheel root")
        checks.add(
            "bnb_gc_fix_pytest.py" in names, "bnb_gc_fix_pytest.py (the pytest plugin) at the wheel root"
        )
        checks.add("bnb_gc_fix/py.typed" in names, "bnb_gc_fix/py.typed")
        checks.add("bnb_gc_fix/__init__.py" in names, "bnb_gc_fix/__init__.py")
        entry_points = archive.read(f"{info}/entry_points.txt").decode() if info else ""
        script = re.search(
            r"^\[console_scripts\][^\[]*^\s*bnb-gc-fix\s*=\s*(\S+)", entry_points, re.MULTILINE
        )
        checks.add(
            script is not None and script.group(1) == CONSOLE_SCRIPT[1],
            "console script bnb-gc-fix = bnb_gc_fix.cli:main",
            script.group(1) if script else "missing",
        )
        plugin = re.search(r"^\[pytest11\][^\[]*^\s*bnb_gc_fix\s*=\s*(\S+)", entry_points, re.MULTILINE)
        checks.add(
            plugin is not None and plugin.group(1) == "bnb_gc_fix_pytest",
            "pytest11 entry point bnb_gc_fix = bnb_gc_fix_pytest",
            plugin.group(1) if plugin else "missing",
        )
        metadata = archive.read(f"{info}/METADATA").decode() if info else ""
        deps = unconditional_requirements(metadata)
        checks.add(
            deps == RUNTIME_DEPS, "runtime requirements are exactly wrapt and packaging", str(sorted(deps))
        )
        stray = sorted(n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/", "docs/")))
        checks.add(not stray, "no tests/benchmarks/scripts/docs in the wheel", ", ".join(stray[:5]))
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    for needed in (
        "bnb_gc_fix.pth",
        "_bnb_gc_fix_boot.py",
        "bnb_gc_fix_pytest.py",
        "pyproject.toml",
        "bnb_gc_fix/py.typed",
    ):
        checks.add(needed in members, f"sdist has {needed}")
    allowed = sdist_top_level()
    if allowed is not None:
        stray = sorted(m for m in members if m.split("/")[0] not in allowed)
        checks.add(not stray, "sdist holds only what pyproject's sdist include lists", ", ".join(stray[:3]))


def sdist_top_level() -> set[str] | None:
    """Top-level names the sdist may hold: pyproject's sdist ``include`` plus what every sdist has."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11: skip this one check
        return None
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    sdist = config.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("sdist", {})
    include = sdist.get("include")
    if not include:
        return None
    return {entry.strip("/").split("/")[0] for entry in include} | {
        "pyproject.toml",
        "PKG-INFO",
        ".gitignore",
    }


# --------------------------------------------------------------------------- fresh venv


def make_venv(root: Path, wheel: Path) -> Path:
    run([sys.executable, "-m", "venv", str(root)])
    python = root / ("Scripts" if os.name == "nt" else "bin") / "python"
    constraints = ["-c", str(CONSTRAINTS)] if CONSTRAINTS.exists() else []
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *constraints]
    env = clean_env()
    run([*pip, TORCH], env=env)
    run([*pip, *STACK], env=env)
    run([*pip, str(wheel)], env=env)
    return python


def scenario(python: Path, workdir: Path, steps: int, switch: str | None) -> dict[str, Any]:
    env = clean_env()
    if switch is not None:
        env["BNB_GC_FIX"] = switch
    command = [str(python), str(workdir / SCENARIO.name), "--steps", str(steps), "--layers", "2"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir, check=False)
    records, summary = [], {}
    for line in done.stdout.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "summary" in value:
            summary = value["summary"]
        elif "step" in value:
            records.append(value)
    label = "unset" if switch is None else switch
    log(f"tiny_olmoe.py with BNB_GC_FIX={label}: rc={done.returncode} in {time.monotonic() - started:.0f}s")
    return {
        "rc": done.returncode,
        "counters": [r.get("counter") for r in records],
        "cache_bytes": [r.get("cache_bytes") for r in records],
        "summary": summary,
        "stderr": done.stderr[-1500:],
    }


def check_venv(python: Path, workdir: Path, steps: int, checks: Checks) -> None:
    env = clean_env()
    where = subprocess.run(
        [str(python), "-c", "import bnb_gc_fix, sys; print(bnb_gc_fix.__file__); print(sys.prefix)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
        check=False,
    ).stdout.split()
    inside = len(where) == 2 and Path(where[0]).resolve().is_relative_to(Path(where[1]).resolve())
    checks.add(inside, "bnb_gc_fix is imported from the venv, not the repo", where[0] if where else "?")

    fix = scenario(python, workdir, steps, None)
    ok = fix["rc"] == 0 and len(fix["counters"]) == steps and all(c == 0 for c in fix["counters"])
    ok = ok and fix["cache_bytes"][-1:] == [0]
    checks.add(ok, "BNB_GC_FIX unset: counter 0 after every step", f"counters {fix['counters']}")
    hook = fix["summary"].get("bnb_gc_fix_imported") and fix["summary"].get("via") == "start-up hook"
    checks.add(bool(hook), "the fix came from the start-up hook", f"via {fix['summary'].get('via')}")
    if fix["rc"] != 0:
        print(fix["stderr"])

    control = scenario(python, workdir, steps, "0")
    leaked = control["rc"] == 0 and bool(control["counters"]) and max(control["counters"]) > 0
    checks.add(leaked, "BNB_GC_FIX=0: the leak is there", f"counters {control['counters']}")
    checks.add(
        control["summary"].get("bnb_gc_fix_imported") is False,
        "BNB_GC_FIX=0: bnb_gc_fix never imported",
    )

    script = python.parent / ("bnb-gc-fix.exe" if os.name == "nt" else "bnb-gc-fix")
    done = subprocess.run(
        [str(script), "status", "--json"], capture_output=True, text=True, env=env, cwd=workdir, check=False
    )
    try:
        status = json.loads(done.stdout)
    except json.JSONDecodeError:
        status = {}
    ok = done.returncode == 0 and status.get("active") is True and status.get("bitsandbytes") == "0.49.2"
    ok = ok and status.get("startup_hook") is True and status.get("affected") is True
    detail = f"active={status.get('active')} bitsandbytes={status.get('bitsandbytes')} "
    detail += f"affected={status.get('affected')} startup_hook={status.get('startup_hook')}"
    checks.add(ok, "bnb-gc-fix status --json: active on bitsandbytes 0.49.2", detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder and print it")
    args = parser.parse_args(argv)

    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bnb-gc-fix-wheel-"))
    checks = Checks()
    try:
        log(f"building into {tmp / 'dist'}")
        wheel, sdist = build(tmp / "dist")
        print(f"wheel: {wheel.name}\nsdist: {sdist.name}")
        inspect_wheel(wheel, sdist, checks)
        log(f"fresh venv at {tmp / 'venv'}")
        python = make_venv(tmp / "venv", wheel)
        workdir = tmp / "scenario"
        workdir.mkdir()
        for scenario in (SCENARIO, SCENARIO.with_name("report.py")):  # the script and what it imports
            shutil.copy2(scenario, workdir / scenario.name)
        check_venv(python, workdir, args.steps, checks)
    except CannotRunError as error:
        print(f"wheel check: cannot run: {error}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - started
    passed = len(checks.results) - len(checks.failed)
    if checks.failed:
        print(f"wheel check: FAIL ({passed}/{len(checks.results)} passed in {seconds:.0f} s)")
        for name in checks.failed:
            print(f"  failed: {name}")
        return 1
    print(f"wheel check: PASS ({passed}/{len(checks.results)} checks in {seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
