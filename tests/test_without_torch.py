"""Without torch (Python 3.9, 3.10, 3.12, 3.13 in the nox cells ``python-3.X``): the installed wheel's
start-up hook stays silent and cheap, ``import bnb_gc_fix`` works, and the CLI says what is missing.

torch's CPU build is at hand for one Python only; these cells prove the rest of what the classifiers
claim. Children run outside the checkout, so they import the installed wheel.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import TORCH, run_python

pytestmark = [
    pytest.mark.bare,
    pytest.mark.skipif(
        TORCH is not None,
        reason="torch is installed: the rest of the suite covers this stack; the nox cells python-3.X "
        "run this file without torch",
    ),
]
HEAVY = {"wrapt", "packaging", "importlib.metadata", "torch", "bitsandbytes", "bnb_gc_fix"}
CONSOLE = str(Path(sys.executable).parent / "bnb-gc-fix")
FRESH = "an environment without torch: there is no warm parent to fork from"


def test_start_up_hook_runs_imports_nothing_costly_and_prints_nothing(tmp_path: Path) -> None:
    code = "import json, sys; print(json.dumps(sorted(sys.modules)))"
    result = run_python(["-c", code], cwd=tmp_path, fresh=FRESH)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    modules = set(json.loads(result.stdout))
    assert "_bnb_gc_fix" in modules
    assert not modules & HEAVY, sorted(modules & HEAVY)


def test_import_works_without_torch_and_status_says_nothing_is_affected(tmp_path: Path) -> None:
    code = (
        "import json, sys, bnb_gc_fix; s = bnb_gc_fix.status(); "
        "print(json.dumps([s.state, s.asked_by, s.fixed, 'torch' in sys.modules]))"
    )
    result = run_python(["-c", code], cwd=tmp_path, fresh=FRESH)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["not affected", "import bnb_gc_fix", False, False]
    facts = json.loads(run_python(["status", "--json"], executable=CONSOLE, cwd=tmp_path, fresh=FRESH).stdout)
    assert facts["state"] == "not affected" and facts["torch"] is None, facts
    assert facts["import_errors"] == ["torch is not installed"], facts
    # Issue 42's finding 8: the text says each fact once, and nothing turned on that nobody asked for.
    text = run_python(["status"], executable=CONSOLE, cwd=tmp_path, fresh=FRESH).stdout
    assert "torch not installed, bitsandbytes not installed" in text.splitlines()[0], text
    assert "state: not affected: bitsandbytes cannot be imported here" in text, text
    assert "import: torch is not installed" in text
    # The fix line says what the fix does here: nothing is in any hooks yet (issue 54).
    said = "fix: goes into bitsandbytes' hooks at the import of bitsandbytes.nn.parametrize, where they leak"
    assert said in " ".join(text.split()), text


def test_check_exits_2_and_says_to_install_torch(tmp_path: Path) -> None:
    result = run_python(["check"], executable=CONSOLE, cwd=tmp_path, fresh=FRESH)
    assert result.returncode == 2 and "install torch" in result.stderr, (result.returncode, result.stderr)
