"""An unrelated project's pytest run, in an environment where the package is installed: it must run as if
the package were not there, warnings as errors included.

The package declares no pytest plugin, so nothing of it is marked for assertion rewriting or loaded by
pytest; the start-up hook imports ``_bnb_gc_fix`` in every process, before pytest starts, and turns the
fix on where a test imports bitsandbytes' 4-bit module. The control is the same run with the package
switched off (``BNB_GC_FIX=0``: the start-up hook then installs nothing), which shows the project's own
result. Each run is pytest's own fresh interpreter. The wheel cell (nox) runs this file too, on the wheel
installed in a fresh venv.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import environment

pytestmark = [pytest.mark.usefixtures("startup_hook_installed"), pytest.mark.wheel]

ARITHMETIC = "def test_arithmetic():\n    assert 1 + 1 == 2\n"
# A test that makes the start-up hook turn the fix on (bitsandbytes' 4-bit module is imported).
QUANTIZER = "def test_quantizer_import():\n    import bitsandbytes.nn.parametrize  # noqa: F401\n"
PROJECTS = {
    # The issue's own: warnings are errors, and one trivial test.
    "filterwarnings-error": ("[pytest]\nfilterwarnings = error\n", {"test_arithmetic.py": ARITHMETIC}),
    # pytest's defaults, and a test that imports bitsandbytes (whose import warns on its own).
    "defaults": ("[pytest]\n", {"test_arithmetic.py": ARITHMETIC, "test_quantizer_import.py": QUANTIZER}),
}


def _project(root: Path, name: str) -> Path:
    config, tests = PROJECTS[name]
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text(config)
    for filename, source in tests.items():
        (root / "tests" / filename).write_text(source)
    return root


def _pytest(project: Path, switch: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
        cwd=project,
        env=environment(switch),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _ours(output: str) -> list[str]:
    """Lines that name the package (the environment's own folder, whatever its name, aside)."""
    lines = output.replace(sys.prefix, "<environment>").splitlines()
    return [line for line in lines if "bnb" in line.lower()]


def _last_line(run: subprocess.CompletedProcess[str]) -> str:
    """pytest's closing line, without its time: ``2 passed, 14 warnings``."""
    return run.stdout.strip().splitlines()[-1].rsplit(" in ", 1)[0]


@pytest.mark.parametrize("name", list(PROJECTS))
def test_an_unrelated_projects_run_ends_as_without_the_package_and_never_names_it(
    tmp_path: Path, name: str
) -> None:
    project = _project(tmp_path / "project", name)
    control = _pytest(project, "0")
    assert control.returncode == 0, control.stdout + control.stderr  # the project is green by itself
    run = _pytest(project, None)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert _last_line(run) == _last_line(control), output  # the same tests, the same warnings
    assert _ours(output) == [] and _ours(control.stdout + control.stderr) == [], output
