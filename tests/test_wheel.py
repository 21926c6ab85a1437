"""The built wheel and sdist, and the wheel installed into a fresh venv (not the editable checkout).

The nox cell ``wheel`` (cells.toml) builds both with ``uv build`` (the wheel from the sdist), installs
the wheel into its fresh venv beside torch, bitsandbytes and transformers, and runs these tests with
``BNB_GC_FIX_DIST`` pointing at the folder it built into. Every child runs outside the checkout, so
nothing of the repository can shadow what the wheel installed.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from conftest import AFFECTED, BITSANDBYTES, ROOT, SCENARIOS, run_python

DIST = os.environ.get("BNB_GC_FIX_DIST")
pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(
        DIST is None,
        reason="runs in the nox cell `wheel` (the built wheel in a fresh venv): nox -s 'cell(wheel)'",
    ),
]
RUNTIME_DEPS = {"wrapt", "packaging"}
STEPS = 3


def _one(pattern: str) -> Path:
    [path] = sorted(Path(str(DIST)).glob(pattern))
    return path


def _requirements(metadata: str) -> set[str]:
    """Requires-Dist names without an environment marker (extras carry ``extra == ...`` markers)."""
    names = set()
    for requirement in email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if match and ";" not in requirement:
            names.add(re.sub(r"[-_.]+", "-", match.group(1)).lower())
    return names


def test_wheel_holds_the_start_up_hook_and_the_console_script_and_no_pytest_plugin() -> None:
    with zipfile.ZipFile(_one("*.whl")) as archive:
        names = set(archive.namelist())
        [info] = sorted({n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")})
        assert archive.read("zz_bnb_gc_fix.pth") == (ROOT / "zz_bnb_gc_fix.pth").read_bytes()
        # PEP 829's start-up file, beside the .pth file at the wheel's root (site-packages).
        assert archive.read("zz_bnb_gc_fix.start") == (ROOT / "zz_bnb_gc_fix.start").read_bytes()
        assert archive.read("_bnb_gc_fix.py") == (ROOT / "_bnb_gc_fix.py").read_bytes()
        for needed in ("bnb_gc_fix/py.typed", "bnb_gc_fix/__init__.py"):
            assert needed in names
        # The wheel's top level: the package, the start-up module and the two start-up files, nothing else.
        top = {name.split("/")[0] for name in names} - {info}
        assert top == {"_bnb_gc_fix.py", "bnb_gc_fix", "zz_bnb_gc_fix.pth", "zz_bnb_gc_fix.start"}, top
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        assert re.search(r"^\[console_scripts\][^\[]*^bnb-gc-fix = bnb_gc_fix\.cli:main$", entry_points, re.M)
        assert "pytest11" not in entry_points  # nothing of the package loads in a pytest run
        assert _requirements(archive.read(f"{info}/METADATA").decode()) == RUNTIME_DEPS
        stray = sorted(n for n in names if n.startswith(("tests/", "benchmarks/", "scripts/", "docs/")))
        assert not stray


def test_sdist_holds_exactly_what_pyproject_includes() -> None:
    with tarfile.open(_one("*.tar.gz")) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    for needed in (
        "zz_bnb_gc_fix.pth",
        "zz_bnb_gc_fix.start",
        "_bnb_gc_fix.py",
        "pyproject.toml",
        "bnb_gc_fix/py.typed",
        "docs/test-suites.md",
    ):
        assert needed in members
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    allowed = {entry.strip("/").split("/")[0] for entry in include} | {
        "pyproject.toml",
        "PKG-INFO",
        ".gitignore",
    }
    assert sorted(m for m in members if m.split("/")[0] not in allowed) == []


def test_the_package_comes_from_the_venv_not_the_checkout(tmp_path: Path) -> None:
    code = "import bnb_gc_fix, json, sys; print(json.dumps([bnb_gc_fix.__file__, sys.prefix]))"
    result = run_python(["-c", code], cwd=tmp_path)
    where, prefix = json.loads(result.stdout)
    assert Path(where).resolve().is_relative_to(Path(prefix).resolve()), where
    assert not Path(where).resolve().is_relative_to(ROOT), where


def _copied_scenario(workdir: Path, switch: str | None) -> tuple[list[int], list[int], dict[str, Any]]:
    """tests/scenarios/tiny_olmoe.py copied out of the repo, run there; it never imports bnb_gc_fix."""
    for name in ("tiny_olmoe.py", "report.py", "tiny_llama_linear.py"):
        shutil.copy2(SCENARIOS / name, workdir / name)
    run = run_python(
        [str(workdir / "tiny_olmoe.py"), "--steps", str(STEPS), "--layers", "2"], switch=switch, cwd=workdir
    )
    assert run.returncode == 0, run.stderr
    return [s["counter"] for s in run.steps], [s["cache_bytes"] for s in run.steps], run.summary


@pytest.mark.skipif(not AFFECTED, reason="the wheel cell pins an affected bitsandbytes")
def test_start_up_hook_fixes_a_script_that_never_imports_the_package(
    tmp_path: Path, record_property: Any
) -> None:
    counters, cache, summary = _copied_scenario(tmp_path, None)
    record_property("counters", json.dumps(counters))
    record_property("matrix", json.dumps("fix"))  # the wheel cell's row in docs/matrix.md
    assert counters == [0] * STEPS and cache[-1] == 0
    assert summary["bnb_gc_fix_imported"] is True and summary["asked_by"] == "the start-up hook", summary


@pytest.mark.skipif(not AFFECTED, reason="the wheel cell pins an affected bitsandbytes")
def test_control_switched_off_leaks_and_never_imports_the_package(
    tmp_path: Path, record_property: Any
) -> None:
    counters, cache, summary = _copied_scenario(tmp_path, "0")
    record_property("counters", json.dumps(counters))
    record_property("matrix", json.dumps("control"))
    assert len(counters) == STEPS and max(counters) > 0 and cache[-1] > 0, counters
    assert summary["bnb_gc_fix_imported"] is False, summary


def test_console_script_status_json(tmp_path: Path) -> None:
    console = str(Path(sys.executable).parent / "bnb-gc-fix")
    fresh = "the console script the wheel installed"
    result = run_python(["status", "--json"], executable=console, cwd=tmp_path, fresh=fresh)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["asked_by"] == "import bnb_gc_fix" and facts["fixed"] is AFFECTED
    assert facts["process"]["state"] == "not affected"  # it quantizes nothing
    assert facts["state"] == ("protected" if AFFECTED else "not affected")  # what a job here gets
    [library] = [lib for lib in facts["libraries"] if lib["name"] == "bitsandbytes"]
    assert library["version"] == BITSANDBYTES, library
    assert library["hooks"] == ("leak this way" if AFFECTED else "do not leak this way"), library
