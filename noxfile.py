"""The test matrix: one nox session a cell of cells.toml, each its own uv venv running pytest.

    nox                              # every cell, one after the other
    nox -l                           # list them
    nox -s "cell(bnb-0.50.2)"        # one cell
    python scripts/readme_table.py   # then: README's version table and docs/matrix.json from the results

Every cell installs its versions (and this checkout, editable, or the wheel built from it) into a venv of
its own and runs pytest there on the same tests, whose expectations come from the installed versions.
Everything it makes stays outside the work tree, in ``$BNB_GC_FIX_NOX`` (default
``~/.cache/bnb-gc-fix-nox``): ``envs/`` (the venvs, reused while a cell's requirements are unchanged),
``uv-cache/`` (uv's cache: venvs link their packages from it instead of copying them) and ``results/``
(``CELL.json``: versions and the outcome of every test, with the properties the tests recorded).

uv reads no pip configuration, so the machine's settings are passed explicitly: a torch ``X+cpu`` comes
from a local folder of wheels where it is there (``$BNB_GC_FIX_CPU_WHEELS``, default ``/opt/wheels``, as
on the CI machine), otherwise from PyTorch's CPU package index (:data:`PYTORCH_CPU_INDEX`): never from
PyPI, which has only CUDA builds for Linux. The cell's torch pin is a constraint of every install in
it. Other torch builds are PyPI's CUDA builds:
where ``~/.cache/bnb-gc-fix-stacks/wheels`` already holds them (with their ``nvidia-*`` wheels), torch
is installed from there alone (``--no-index``), so nothing is downloaded again.

A version ``"*"`` in cells.toml means the newest release, resolved each time the cell runs (the cell
``latest``): its torch is the newest CPU build of PyTorch's CPU index, or PyPI's newest (a CUDA build,
about 3 GB with its ``nvidia-*`` wheels) where that index cannot be reached, and its bitsandbytes and
transformers are upgraded to PyPI's newest even in a reused venv.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import nox
import nox.command
import tomllib

ROOT = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("BNB_GC_FIX_NOX") or Path.home() / ".cache" / "bnb-gc-fix-nox")
RESULTS = CACHE / "results"
CPU_WHEELS = Path(os.environ.get("BNB_GC_FIX_CPU_WHEELS") or "/opt/wheels")
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_WHEELS = Path(
    os.environ.get("BNB_GC_FIX_STACKS_CACHE") or Path.home() / ".cache" / "bnb-gc-fix-stacks"
) / ("wheels")
CELLS: list[dict[str, Any]] = tomllib.loads((ROOT / "cells.toml").read_text())["cells"]
# What every cell needs to run the tests; with torch also what the Trainer tests use.
TOOLS = ["pytest>=7", "pytest-xdist>=3", "pip"]
WITH_TORCH = ["accelerate>=1.1"]
WORKERS = os.environ.get("BNB_GC_FIX_NOX_WORKERS", "2")  # pytest-xdist workers in a cell

nox.options.envdir = str(CACHE / "envs")
nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.download_python = "never"
nox.options.error_on_missing_interpreters = True

VERSIONS = (
    "import json, platform; from importlib import metadata as m\n"
    "def v(n):\n"
    "    try: return m.version(n)\n"
    "    except m.PackageNotFoundError: return None\n"
    "print(json.dumps({'python': platform.python_version(),"
    " **{n: v(n) for n in ('torch', 'bitsandbytes', 'transformers', 'bnb-gc-fix')}}))"
)


def interpreter(version: str) -> str:
    """pyenv's ``X.Y[.Z]`` first (its shims answer only for the selected versions), else the version."""
    pyenv = Path.home() / ".pyenv" / "versions"
    found = [pyenv / version] if (pyenv / version).is_dir() else sorted(pyenv.glob(f"{version}.*"))
    pythons = [p / "bin" / "python" for p in found if (p / "bin" / "python").exists()]
    return str(pythons[-1]) if pythons else version


NEWEST = "*"  # a version in cells.toml: the newest release, resolved when the cell runs


def requirements(cell: dict[str, Any]) -> list[str]:
    pins = []
    for name in ("torch", "bitsandbytes", "transformers"):
        if cell[name]:
            pins.append(name if cell[name] == NEWEST else f"{name}=={cell[name]}")
    return [*pins, *cell["extras"], *TOOLS, *(WITH_TORCH if cell["torch"] else [])]


def upgrades(cell: dict[str, Any]) -> list[str]:
    """uv's ``--upgrade-package`` for each newest-release library: a reused venv gets today's newest."""
    names = [n for n in ("bitsandbytes", "transformers") if cell[n] == NEWEST]
    return [arg for name in names for arg in ("--upgrade-package", name)]


def uv_env(session: nox.Session, cell: dict[str, Any]) -> None:
    """What pip's machine-wide configuration says, for uv; the cell's torch pin as a constraint."""
    links = [str(p) for p in (CPU_WHEELS, CUDA_WHEELS) if p.is_dir()]
    session.env["UV_CACHE_DIR"] = str(CACHE / "uv-cache")
    session.env["UV_FIND_LINKS"] = ",".join(links)
    session.env.pop("PIP_CONSTRAINT", None)
    constraint = CACHE / "constraints" / f"{cell['name']}.txt"
    constraint.parent.mkdir(parents=True, exist_ok=True)
    pinned = cell["torch"] and cell["torch"] != NEWEST  # the newest: pinned once installed (install_torch)
    constraint.write_text(f"torch=={cell['torch']}\n" if pinned else "")
    session.env["UV_CONSTRAINT"] = str(constraint)
    torch = cell["torch"]
    if torch.endswith("+cpu") and not glob.glob(str(CPU_WHEELS / f"torch-{torch}-*.whl")):
        # No local CPU wheel: PyTorch's CPU index, which uv asks before the default index (and takes a
        # package from the first index that has it); the default index for everything it does not hold.
        session.env["UV_EXTRA_INDEX_URL"] = PYTORCH_CPU_INDEX
    session.env["UV_PYTHON_DOWNLOADS"] = "never"
    # Byte-compile at install, as pip does: the tests start many fresh interpreters, and where
    # PYTHONDONTWRITEBYTECODE is set each would otherwise compile torch and transformers anew.
    session.env["UV_COMPILE_BYTECODE"] = "1"


def install_newest_torch(session: nox.Session, cell: dict[str, Any]) -> None:
    """The newest torch: a CPU build from PyTorch's CPU index, else PyPI's newest; then pinned as installed,
    so that the cell's other installs never swap it for another build."""
    extras = [e for e in cell["extras"] if e.split("<")[0].split("=")[0].strip() == "numpy"]
    try:  # uv asks an extra index before the default one, and takes torch from the first that has it
        session.install(
            "--upgrade-package", "torch", "--extra-index-url", PYTORCH_CPU_INDEX, "torch", *extras
        )
    except nox.command.CommandFailed:
        session.log(f"{PYTORCH_CPU_INDEX} cannot be reached: the newest torch from PyPI (a CUDA build)")
        session.install("--upgrade-package", "torch", "torch", *extras)
    # The distribution's version (torch.__version__ may carry a build tag, 2.15.0+cu132, that no index has).
    code = "from importlib.metadata import version; print(version('torch'))"
    printed = session.run("python", "-c", code, silent=True) or ""
    session.log(f"the newest torch: {printed.strip()}")
    (CACHE / "constraints" / f"{cell['name']}.txt").write_text(f"torch=={printed.strip().splitlines()[-1]}\n")


def install_torch(session: nox.Session, cell: dict[str, Any]) -> None:
    """A CUDA torch from the stacks' wheel folder alone where it is there (nothing downloaded); the newest
    torch for a cell that asks for it."""
    torch = cell["torch"]
    if torch == NEWEST:
        install_newest_torch(session, cell)
        return
    tag = "cp" + "".join(cell["python"].split(".")[:2])
    if not torch or "+" in torch or not glob.glob(str(CUDA_WHEELS / f"torch-{torch}-{tag}-*.whl")):
        return
    # torch and its own requirements alone: the cell's extras (numpy<2) come with its next install, from
    # the index where the folder lacks them.
    session.install("--no-index", "--find-links", str(CUDA_WHEELS), f"torch=={torch}")


def build_wheel(session: nox.Session, outdir: Path) -> Path:
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    session.run(uv, "build", "--quiet", "--out-dir", str(outdir), str(ROOT), external=True)
    wheels = sorted(outdir.glob("*.whl"))
    if len(wheels) != 1 or len(sorted(outdir.glob("*.tar.gz"))) != 1:
        session.error(f"expected one wheel and one sdist in {outdir}")
    return wheels[0]


def junit(path: Path) -> list[dict[str, Any]]:
    """Each test case of a junit XML: outcome, seconds, and what the test recorded (record_property)."""
    tests: list[dict[str, Any]] = []
    for case in ET.parse(path).iter("testcase"):
        outcome = "passed"
        for child, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(child) is not None:
                outcome = name
        properties = {str(p.get("name")): p.get("value") for p in case.iter("property")}
        tests.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": round(float(case.get("time") or 0), 1),
                **properties,
            }
        )
    return tests


@nox.session
@nox.parametrize(
    ("python", "name"),
    [(interpreter(c["python"]), c["name"]) for c in CELLS],
    ids=[c["name"] for c in CELLS],
)
def cell(session: nox.Session, name: str) -> None:
    """One cell of cells.toml: install its versions, run its tests, write results/CELL.json."""
    spec = next(c for c in CELLS if c["name"] == name)
    uv_env(session, spec)
    install_torch(session, spec)
    session.install(*upgrades(spec), *requirements(spec))
    with tempfile.TemporaryDirectory(prefix="bnb-gc-fix-nox-") as tmp:
        work = Path(tmp)
        if spec["install"] == "wheel":
            wheel = build_wheel(session, work / "dist")
            session.install("--reinstall-package", "bnb-gc-fix", str(wheel))
            session.env["BNB_GC_FIX_DIST"] = str(work / "dist")
        else:
            session.install("-e", str(ROOT))  # with its two runtime dependencies
        session.env["BNB_GC_FIX_CELL"] = name
        session.env["BNB_GC_FIX_DOWNLOADS"] = "1"  # a cell runs every test it selects
        for variable in ("PYTHONPATH", "BNB_GC_FIX", "VIRTUAL_ENV"):
            session.env.pop(variable, None)
        printed = session.run("python", "-c", VERSIONS, silent=True) or "{}"
        versions = json.loads(printed.strip().splitlines()[-1])
        runs = [["-m", spec["marker"], "tests"]] + [[f] for f in spec["files"] if (ROOT / f).exists()]
        tests: list[dict[str, Any]] = []
        for index, selection in enumerate(runs):
            report = work / f"junit{index}.xml"
            session.run(
                "pytest",  # not `python -m pytest`: the repo root must not shadow an installed wheel
                "-q",
                "-p",
                "no:cacheprovider",
                "-n",
                WORKERS,
                "-o",
                "junit_family=xunit1",  # keeps the tests' record_property without a warning
                "-W",  # a wheel's top-level modules are marked for rewriting; the start-up hook ran first
                "ignore:Module already imported so cannot be rewritten",
                f"--junitxml={report}",
                *selection,
                *session.posargs,
                success_codes=range(6),  # judged below from the junit report
            )
            tests += junit(report) if report.exists() else [{"test": str(selection), "outcome": "error"}]
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    verdict = "PASS" if counts["passed"] and not counts["failed"] + counts["error"] else "FAIL"
    row = {"cell": spec, "versions": versions, "counts": counts, "verdict": verdict, "tests": tests}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(row, indent=1) + "\n")
    if verdict != "PASS":
        session.error(f"{name}: {counts}")
