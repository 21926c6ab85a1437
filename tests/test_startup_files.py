"""The start-up files: the package's own installation only, and Python 3.15's ``.start`` file.

* A ``bnb_gc_fix.py`` in the working directory never runs when the start-up hook imports the package
  (it loads the package from the folder it was installed in); plain Python, and the control
  (``BNB_GC_FIX=0``), run nothing of it either.
* PEP 829 (Python 3.15+): ``import`` lines in ``.pth`` files warn from 3.15 and are ignored from 3.18;
  a ``<name>.start`` file holding an entry point (``module:callable``) replaces them, and where a
  matching ``.start`` file exists the ``.pth`` file's import line is not run. No 3.15 interpreter can be
  had here, so these tests check the contract the PEP specifies: the file's name and place, its one
  line resolved by ``pkgutil.resolve_name`` and called with no arguments in a fresh interpreter that
  ran no ``.pth`` import line, and the start-up function safe to call twice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import AFFECTED, FIX, PRELUDES, ROOT, UNDER_TEST, environment, run_code, run_python

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

# --- a module of our name in the working directory ------------------------------------------------

# Each shadow leaves a file named after itself when it runs.
SHADOW = "open(__file__ + '.ran', 'w').close()\n"
SHADOWED = ("bnb_gc_fix", "_bnb_gc_fix")

# A training script that never imports the package: the start-up hook alone turns the fix on.
TRAIN = """
import torch
import quantized
module = quantized.make()
counters = quantized.checkpointed_counters(module)
package = sys.modules.get("bnb_gc_fix")
print(json.dumps({
    "counters": counters,
    "package": getattr(package, "__file__", None),
    "by": package.status().asked_by if package is not None else None,
}))
"""


def _shadowed_run(folder: Path, how: str, switch: str | None) -> dict[str, Any]:
    """Run the training script in ``folder`` (``python train.py``) or as ``python -c`` there."""
    fresh = "the start-up hook's import at interpreter start, with the folder's shadows on the path"
    if how == "script":
        script = folder / "train.py"
        script.write_text(PRELUDES["scenarios"] + TRAIN)
        result = run_python([str(script)], switch=switch, cwd=folder, fresh=fresh)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        result = run_code(TRAIN, prelude="scenarios", switch=switch, cwd=folder, fresh=fresh)
    ran = sorted(path.name for path in folder.glob("*.ran"))
    return {**result.last_json, "shadows that ran": ran}


@pytest.mark.parametrize("how", ["script", "-c"])
def test_a_module_of_our_name_in_the_working_directory_never_runs_and_the_fix_turns_on(
    tmp_path: Path, how: str
) -> None:
    for name in SHADOWED:
        (tmp_path / f"{name}.py").write_text(SHADOW)
    fixed = _shadowed_run(tmp_path, how, FIX)
    assert fixed["shadows that ran"] == []
    assert fixed["package"] == str(UNDER_TEST / "bnb_gc_fix" / "__init__.py")
    assert fixed["counters"] == [0, 0, 0]
    assert fixed["by"] == "the start-up hook"
    if how != "script":
        return
    # The control (once: it does not depend on how the script runs): nothing of the shadows runs
    # either, and bitsandbytes' pair does what it does.
    control = _shadowed_run(tmp_path, how, "0")
    assert control["shadows that ran"] == [] and control["package"] is None
    if AFFECTED:
        assert control["counters"][-1] > control["counters"][0] > 0
    else:
        assert control["counters"] == [0, 0, 0]


# --- bnb_gc_fix.start ------------------------------------------------------------------------------

START = ROOT / "zz_bnb_gc_fix.start"

# A fresh interpreter started with -S (no site: no .pth file processed), given the site-packages
# folders and the paths their .pth files add, as a Python that runs .start files instead of .pth
# import lines sets them up; then the .start file's entry point, resolved and called with no
# arguments, sys.argv[2] times.
AS_PYTHON_3_15 = """
import json, os, pkgutil, sys
site_packages = json.loads(sys.argv[1])
for folder in site_packages:
    sys.path.append(folder)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".pth"):
            continue
        for line in open(os.path.join(folder, name)):
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\\t")):
                sys.path.append(os.path.join(folder, line))
entry = [line.strip() for line in open(sys.argv[3]) if line.strip() and not line.startswith("#")]
assert len(entry) == 1, entry
start = pkgutil.resolve_name(entry[0])
for _ in range(int(sys.argv[2])):
    start()
"""

WATCHERS_AND_TRAINING = """
watchers = [f for f in sys.meta_path if type(f).__name__ == "Watcher"]
import torch
import quantized
module = quantized.make()
counters = quantized.checkpointed_counters(module)
package = sys.modules.get("bnb_gc_fix")
print(json.dumps({
    "watchers": len(watchers),
    "counters": counters,
    "by": package.status().asked_by if package is not None else None,
}))
"""


def _site_packages() -> list[str]:
    folders: list[str] = run_code("import json, site; print(json.dumps(site.getsitepackages()))").last_json
    return folders


def test_the_start_file_names_the_start_up_function_and_is_installed_beside_the_pth_file() -> None:
    lines = [line for line in START.read_text().splitlines() if line.strip()]
    assert lines == ["_bnb_gc_fix:install"]
    installed = [Path(folder) / "zz_bnb_gc_fix.start" for folder in _site_packages()]
    assert any(path.exists() and path.read_text() == START.read_text() for path in installed)
    assert any((path.parent / "zz_bnb_gc_fix.pth").exists() for path in installed if path.exists())


def _as_python_3_15(calls: int, switch: str | None) -> dict[str, Any]:
    argv = [json.dumps(_site_packages()), str(calls), str(START)]
    code = PRELUDES["scenarios"] + AS_PYTHON_3_15 + WATCHERS_AND_TRAINING
    result = run_python(
        ["-S", "-c", code, *argv], env=environment(switch), fresh="python -S: no .pth file runs"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(result.last_json)


def test_the_start_files_entry_point_alone_turns_the_fix_on_once_even_called_twice() -> None:
    twice = _as_python_3_15(calls=2, switch=FIX)  # once is what each of the two calls does
    assert twice["watchers"] == 1
    assert twice["counters"] == [0, 0, 0]
    assert twice["by"] == "the start-up hook"


def test_the_start_files_entry_point_control_switched_off_installs_nothing() -> None:
    control = _as_python_3_15(calls=1, switch="0")
    assert control["watchers"] == 0 and control["by"] is None
    if AFFECTED:
        assert control["counters"][-1] > control["counters"][0] > 0
    else:
        assert control["counters"] == [0, 0, 0]


def test_the_start_up_function_called_again_after_the_pth_file_installs_no_second_watcher() -> None:
    # A Python that ran the .pth file's import line, and something (a .start file) calling it again.
    code = "import _bnb_gc_fix\n_bnb_gc_fix.install()\n" + WATCHERS_AND_TRAINING
    run = run_code(code, prelude="scenarios", switch=FIX).last_json
    assert run["watchers"] == 1 and run["counters"] == [0, 0, 0]


def test_this_python_is_not_one_that_runs_start_files() -> None:
    # What the tests above emulate: say so where a real one runs them (Python 3.15+), so that the
    # emulation is replaced by the real thing there.
    if sys.version_info >= (3, 15):
        pytest.fail("Python 3.15+ runs .start files: test zz_bnb_gc_fix.start on it directly")


# --- what the start-up module holds ---------------------------------------------------------------

# Issue 51: the start-up module, loaded into every Python process, holds the watched modules' names and
# nothing used only in messages. Issue 55: the names are said there alone; the package takes them from it.
WATCHED_AND_SAID = """
import json
import _bnb_gc_fix
from bnb_gc_fix.libraries import LIBRARIES
print(json.dumps({
    "watched": list(_bnb_gc_fix.WATCHED),
    "taken": [library.module_name is watched for library, watched in zip(LIBRARIES, _bnb_gc_fix.WATCHED)],
    "message_names": [name for name in ("Library", "LIBRARIES", "AXOLOTL") if hasattr(_bnb_gc_fix, name)],
}))
"""


def test_the_start_up_module_says_the_watched_modules_once_and_holds_no_message() -> None:
    out = run_code(WATCHED_AND_SAID, switch="0").last_json
    assert out["watched"] and out["taken"] == [True] * len(out["watched"]) and out["message_names"] == []
