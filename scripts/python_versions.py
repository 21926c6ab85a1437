"""Check the wheel on every Python the classifiers claim, where torch cannot be installed.

torch's CPU build on this machine exists for one Python only, so the version matrix runs on
that one. This script proves the rest of the claim (``requires-python`` and the classifiers):
on each other interpreter it finds (3.9, 3.10, 3.12, 3.13), it builds a fresh venv, installs
the wheel with its two runtime dependencies, and checks that

* the start-up hook runs at interpreter start, imports nothing costly, and prints nothing;
* ``import bnb_gc_fix`` works, imports no torch, and ``status()`` says bitsandbytes is missing;
* ``bnb-gc-fix status --json`` answers and ``bnb-gc-fix check`` exits 2 (cannot run).

    python scripts/python_versions.py            # interpreters not found are reported as skipped

Standard library only. Exits non-zero if a found interpreter fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("3.9", "3.10", "3.12", "3.13")
HEAVY = ("wrapt", "packaging", "importlib.metadata", "torch", "bitsandbytes", "bnb_gc_fix")


def find_interpreter(version: str) -> str | None:
    pyenv = Path.home() / ".pyenv" / "versions"
    for candidate in sorted(pyenv.glob(f"{version}.*"), reverse=True):
        python = candidate / "bin" / "python"
        if python.exists():
            return str(python)
    found = shutil.which(f"python{version}")
    if found and "/shims/" not in found:  # a pyenv shim answers even for versions it lacks
        return found
    return None


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)  # type: ignore[call-overload, no-any-return]


def build_wheel(outdir: Path) -> Path:
    if run([sys.executable, "-c", "import build"]).returncode != 0:
        run([sys.executable, "-m", "pip", "install", "--quiet", "build"])
    result = run([sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(ROOT)])
    if result.returncode != 0:
        raise SystemExit(f"building the wheel failed:\n{result.stderr}")
    return next(outdir.glob("*.whl"))


def check(version: str, interpreter: str, wheel: Path, workdir: Path) -> list[str]:
    venv = workdir / f"venv-{version}"
    problems: list[str] = []
    made = run([interpreter, "-m", "venv", str(venv)])
    if made.returncode != 0:
        return [f"venv: {made.stderr.strip()}"]
    python, console = str(venv / "bin" / "python"), str(venv / "bin" / "bnb-gc-fix")
    installed = run([python, "-m", "pip", "install", "--quiet", str(wheel)])
    if installed.returncode != 0:
        return [f"pip install: {installed.stderr.strip()[-500:]}"]

    start = run([python, "-c", "import sys; print(sorted(sys.modules))"], cwd=workdir)
    modules = set(json.loads(start.stdout.replace("'", '"'))) if start.returncode == 0 else set()
    if start.stderr:
        problems.append(f"interpreter start printed: {start.stderr.strip()}")
    if "_bnb_gc_fix_boot" not in modules:
        problems.append("the start-up hook did not run")
    if modules & set(HEAVY):
        problems.append(f"start-up imported {sorted(modules & set(HEAVY))}")

    probe = (
        "import json, sys, bnb_gc_fix; s = bnb_gc_fix.status(); "
        "print(json.dumps([s.active, s.reason, 'torch' in sys.modules]))"
    )
    imported = run([python, "-c", probe], cwd=workdir)
    if imported.returncode != 0:
        problems.append(f"import bnb_gc_fix failed: {imported.stderr.strip()[-500:]}")
    else:
        active, reason, torch_imported = json.loads(imported.stdout)
        if active or "not installed" not in reason or torch_imported:
            problems.append(f"status() without bitsandbytes: {active=} {torch_imported=} {reason!r}")

    status = run([console, "status", "--json"], cwd=workdir)
    if status.returncode != 0 or json.loads(status.stdout or "{}").get("torch", "x") is not None:
        problems.append(f"bnb-gc-fix status --json: rc {status.returncode} {status.stdout[-300:]}")
    checked = run([console, "check"], cwd=workdir)
    if checked.returncode != 2 or "install torch" not in checked.stderr:
        problems.append(f"bnb-gc-fix check: rc {checked.returncode}, expected 2: {checked.stderr.strip()}")
    return problems


def main() -> int:
    failed = False
    with tempfile.TemporaryDirectory(prefix="bnb-gc-fix-pythons-") as tmp:
        workdir = Path(tmp)
        wheel = build_wheel(workdir / "dist")
        rows = []
        for version in VERSIONS:
            interpreter = find_interpreter(version)
            if interpreter is None:
                rows.append((version, "SKIP", "interpreter not found"))
                continue
            problems = check(version, interpreter, wheel, workdir)
            failed = failed or bool(problems)
            rows.append((version, "FAIL" if problems else "PASS", "; ".join(problems) or interpreter))
    print("| Python | verdict | detail |\n|---|---|---|")
    for version, verdict, detail in rows:
        print(f"| {version} | {verdict} | {detail} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
