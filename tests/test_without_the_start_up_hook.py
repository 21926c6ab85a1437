"""Where the start-up hook cannot run, the two documented ways turn the fix on, each beside its control.

The package is installed with ``pip install --target`` into a folder on ``PYTHONPATH``, which Python puts
on ``sys.path`` without processing its ``.pth`` files, as where it is installed outside site-packages (a
shared ``PYTHONPATH``). The interpreter is a venv of its own that sees this environment's packages (torch,
bitsandbytes) through a plain path line, which does not process the ``.pth`` files there either: nothing of
the package runs at start. Then a ``sitecustomize.py`` of the user's own with ``import bnb_gc_fix``, or
that line at the top of the script, turns the fix on; without them the same script leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    AFFECTED,
    ROOT,
    SCENARIOS,
    bare_venv,
    cli_calls,
    command,
    environment,
    run_python,
    unwrapped,
)

pytestmark = pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes: a leak to fix")
FRESH = "a venv of its own, whose site-packages holds no start-up hook"

# A training script that never imports the package; its last line says what happened.
TRAIN = f"""
import json, sys
sys.path.insert(0, {str(SCENARIOS)!r})
import quantized
counters = quantized.checkpointed_counters(quantized.make())
print(json.dumps({{"counters": counters, "package": "bnb_gc_fix" in sys.modules}}))
"""


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A venv without the package's start-up hook, and a folder the package is installed into."""
    root = tmp_path_factory.mktemp("elsewhere")
    python = bare_venv(root / "venv", sees_this_environment=True).python
    target = root / "installed"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(ROOT)]
    subprocess.run(pip, check=True, capture_output=True, timeout=600)
    return python, target


def _train(python: Path, folders: list[Path], script: str, tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = environment(PYTHONPATH=os.pathsep.join(map(str, folders)))
    run = run_python([str(path)], env=env, executable=str(python), cwd=tmp_path, fresh=FRESH)
    assert run.returncode == 0, run.stderr
    return dict(run.last_json)


def test_the_start_up_hook_does_not_run_there(elsewhere: tuple[Path, Path], tmp_path: Path) -> None:
    python, target = elsewhere
    assert (target / "zz_bnb_gc_fix.pth").exists()  # installed, and not processed
    out = _train(python, [target], TRAIN, tmp_path)
    assert out["package"] is False and out["counters"][-1] > out["counters"][0] > 0  # type: ignore[index]


def test_a_sitecustomize_of_ones_own_turns_the_fix_on(elsewhere: tuple[Path, Path], tmp_path: Path) -> None:
    python, target = elsewhere
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import bnb_gc_fix\n")
    out = _train(python, [site, target], TRAIN, tmp_path)
    assert out == {"counters": [0, 0, 0], "package": True}


def test_the_import_at_the_top_of_the_script_turns_the_fix_on(
    elsewhere: tuple[Path, Path], tmp_path: Path
) -> None:
    python, target = elsewhere
    out = _train(python, [target], "import bnb_gc_fix\n" + TRAIN, tmp_path)
    assert out == {"counters": [0, 0, 0], "package": True}


def test_the_package_there_is_the_installed_one(elsewhere: tuple[Path, Path], tmp_path: Path) -> None:
    python, target = elsewhere
    code = "import bnb_gc_fix, json; print(json.dumps(bnb_gc_fix.__file__))"
    out = run_python(
        ["-c", code],
        env=environment(PYTHONPATH=str(target)),
        executable=str(python),
        cwd=tmp_path,
        fresh=FRESH,
    )
    assert json.loads(out.stdout) == str(target / "bnb_gc_fix" / "__init__.py")


def test_status_says_where_the_start_up_hook_did_not_run(
    elsewhere: tuple[Path, Path], tmp_path: Path
) -> None:
    python, target = elsewhere
    env = environment(PYTHONPATH=str(target))
    there, text = cli_calls(["status", "--json"], ["status"], env=env, executable=str(python), fresh=FRESH)
    _, here, _ = command("status", "--json")  # the control: this environment runs it
    assert json.loads(there[1])["start_up_hook_ran"] is False
    assert json.loads(here)["start_up_hook_ran"] is True
    assert "the start-up hook did not run here, so a process that never imports" in unwrapped(text[1])
