"""Hostile hosts: the package runs in every process, so every failure mode must beat the bug's.

The rule for each scenario: where the control runs (``BNB_GC_FIX=0``, or the same program without
the package's help), the fixed run runs too, and ends no worse. Each runs in a fresh interpreter.
The torch.compile scenarios are in ``test_compile.py``; the gate's invariant over random programs in
``test_gate_invariants.py``.
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
    BITSANDBYTES,
    cli_calls,
    environment,
    pip_target,
    run_code,
    run_python,
)

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

# --- the doctor on broken installs ---------------------------------------------------------------

BROKEN = {
    "bitsandbytes-cuda-setup": (
        "bitsandbytes",
        "RuntimeError('CUDA Setup failed despite GPU being available')",
    ),
    "bitsandbytes-missing-library": (
        "bitsandbytes",
        "OSError('libcudart.so.12: cannot open shared object file: No such file or directory')",
    ),
    "bitsandbytes-exits": ("bitsandbytes", "SystemExit('a package that calls sys.exit at import')"),
    "torch-missing-library": ("torch", "OSError('libtorch_cuda.so: cannot open shared object file')"),
    "axolotl-broken": ("axolotl", "RuntimeError('axolotl cannot start here')"),
}


def _broken_install(tmp_path: Path, name: str, raises: str) -> Path:
    """A folder that shadows ``name`` with an installed (dist-info) package whose import raises."""
    folder = tmp_path / "broken"
    package = folder / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise {raises}\n")
    if name == "axolotl":
        (package / "monkeypatch").mkdir()
    info = folder / f"{name}-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 9.9.9\n")
    return folder


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_doctor_answers_for_a_broken_install(tmp_path: Path, case: str) -> None:
    name, raises = BROKEN[case]
    env = environment(PYTHONPATH=str(_broken_install(tmp_path, name, raises)))
    checks = [] if name == "axolotl" else [["check", "--json", "--steps", "1"]]
    text, as_json, *check = cli_calls(["status"], ["status", "--json"], *checks, env=env)
    assert text[0] == 0, text[2]
    assert "Traceback" not in text[2]
    assert as_json[0] == 0, as_json[2]
    [line] = as_json[1].splitlines()
    facts = json.loads(line)
    # Installed and failing is named as such, with what it raised; never "not installed".
    [failure] = [
        problem for module, problem in facts["import_errors"].items() if module.split(".")[0] == name
    ]
    assert f"{name} 9.9.9 is installed but" in failure and "fails to import" in failure, failure
    assert raises.split("(")[0] in failure
    assert "fails to import" in text[1]
    if name == "axolotl":
        assert facts["libraries"][0]["version"] == BITSANDBYTES  # the rest of the report is whole
        return
    reason = facts["libraries"][0]["reason"]
    assert reason == f"{failure}; nothing to patch" and facts["reason"] == reason
    [(code, out, err)] = check
    assert code == 2, err
    [line] = out.splitlines()
    report = json.loads(line)
    assert report["exit_code"] == 2 and "is installed but fails to import" in report["error"]
    assert "install bitsandbytes>=0.48" not in report["error"]


def test_doctor_exits_quietly_on_a_closed_stdout() -> None:
    # (Usage errors under --json: tests/test_command_line.py, test_command_line_messages_...)
    # `bnb-gc-fix status --json | true`: the reader is gone before anything is written.
    script = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'bnb_gc_fix', 'status', '--json'],"
        " stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
        "p.stdout.close()\n"
        "err = p.stderr.read().decode()\n"
        "print(p.wait(), 'Traceback' in err, 'BrokenPipe' in err)\n"
    )
    assert run_code(script).stdout.split() == ["0", "False", "False"]


def test_status_with_the_switch_off_gives_one_answer() -> None:
    (_, line, _), (_, text, _) = cli_calls(["status", "--json"], ["status"], switch="0")
    facts = json.loads(line)
    [bnb] = facts["libraries"]
    assert bnb["affected"] is AFFECTED and bnb["state"] == facts["state"] == "off"
    assert facts["active"] is False and facts["mode"] == "off" and facts["switch"] == "0"
    assert "disabled by the environment" in facts["reason"]
    assert facts["startup_hook"] == "switched off"
    lines = text.splitlines()
    assert "start-up hook:    switched off" in lines
    yes = "yes" if AFFECTED else "no"
    assert f"bitsandbytes {BITSANDBYTES}: off" in lines
    # Nothing was decided with the fix off, and status() never probes: what its version says.
    assert bnb["probe"] is None
    assert [line for line in lines if line.lstrip().startswith("affected:")] == [
        f"  affected:       {yes} (by its version; its code was not probed)"
    ]


# --- the runner keeps PYTHONPATH ---------------------------------------------------------------


def test_runner_keeps_empty_pythonpath_entries(tmp_path: Path) -> None:
    (tmp_path / "toplevel_pkg").mkdir()
    (tmp_path / "toplevel_pkg" / "__init__.py").write_text("NAME = 'from the project root'\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "script.py").write_text("import toplevel_pkg; print(toplevel_pkg.NAME)\n")
    # What `export PYTHONPATH=$PYTHONPATH:/x` leaves when it was unset: an empty entry, the cwd.
    env = environment(PYTHONPATH=os.pathsep + str(tmp_path / "elsewhere"))
    plain = run_python(["sub/script.py"], env=env, cwd=tmp_path)
    assert plain.stdout.strip() == "from the project root", plain.stderr  # the control runs
    runner = [str(Path(sys.executable).parent / "bnb-gc-fix"), "run", "--", sys.executable, "sub/script.py"]
    ran = subprocess.run(runner, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.stdout.strip() == "from the project root", ran.stderr


# --- status is live truth ------------------------------------------------------------------------

LEAK = """
import torch
from torch.utils.checkpoint import checkpoint
import quantized

def steps(module, n=3):
    counters = []
    for _ in range(n):
        x = torch.randn(4, 64, requires_grad=True)
        checkpoint(module, x, use_reentrant=False).pow(2).mean().backward()
        counters.append(quantized.counter())
    return counters
"""

RELOAD = (
    LEAK
    + """
import importlib
import bnb_gc_fix
import bitsandbytes.nn.parametrize as parametrize
out = {"first": bnb_gc_fix.status().state}
if sys.argv[1] == "reload":
    importlib.reload(parametrize)
else:
    del sys.modules["bitsandbytes.nn.parametrize"]
    import bitsandbytes.nn.parametrize as parametrize
s = bnb_gc_fix.status()
out["after"] = [s.state, s.active, s.reason]
def quantize_with(module):  # the target module as imported now, reloaded or new
    fresh = quantized.Quantized()
    module.replace_parameter_4bit(fresh, "w0", quant_type="nf4")
    return fresh
out["unfixed"] = steps(quantize_with(parametrize))
s = bnb_gc_fix.activate()
out["activated"] = [s.state, s.active]
import torch.nn.utils.parametrize as P
P._cache_enabled = 0
P._cache = {}
out["fixed"] = steps(quantize_with(parametrize))
print(json.dumps(out))
"""
)


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes (it is not patched otherwise)")
@pytest.mark.parametrize("how", ["reload", "reimport"])
def test_a_reloaded_target_module_is_reported_unpatched_and_activate_repairs_it(how: str) -> None:
    out = run_code(RELOAD, how, prelude="scenarios").last_json
    assert out["first"] == "patched"
    state, active, reason = out["after"]
    assert (state, active) == ("unpatched", False) and "activate() patches it again" in reason
    assert out["unfixed"][-1] > 0  # what "unpatched" means: the new module's pair leaks
    assert out["activated"] == ["patched", True]
    assert out["fixed"] == [0, 0, 0]


LATE = (
    LEAK
    + """
module = quantized.make()  # quantized before the fix is active
import bnb_gc_fix
s = bnb_gc_fix.status()
leaking = steps(module)
repaired = bnb_gc_fix.repair(module)
bnb_gc_fix.reset()
print(json.dumps({"state": s.state, "reason": s.reason, "leaking": leaking, "repaired": repaired,
                  "after": steps(module)}))
"""
)


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes")
def test_activated_late_status_points_at_repair() -> None:
    out = run_code(LATE, prelude="scenarios-without-startup-hook").last_json
    assert out["state"] == "patched"
    assert "already imported when the fix was activated" in out["reason"]
    assert "bnb_gc_fix.repair(model)" in out["reason"]
    assert out["leaking"][-1] > 0  # the truth status now names
    assert out["repaired"] == 1 and out["after"] == [0, 0, 0]


# --- the start-up hook never perturbs the import system -----------------------------------------

FINDER_AFTER = """
import sys
import wrapt
# Another library's post-import hook (ddtrace, opentelemetry, ...): wrapt's finder is in place already.
wrapt.register_post_import_hook(lambda module: None, "an_unrelated_module")
asked = []

class Vendored:
    def find_spec(self, name, path=None, target=None):
        asked.append(name)
        return None

position = next((i for i, f in enumerate(sys.meta_path) if getattr(f, "bnb_gc_fix_watcher", False)), -1)
sys.meta_path.insert(position + 1, Vendored())
import bitsandbytes.nn.parametrize
print(asked.count("bitsandbytes.nn.parametrize"), "bnb_gc_fix" in sys.modules)
"""


@pytest.mark.parametrize("switch", [None, "0"])
def test_a_finder_after_the_watcher_sees_the_watched_modules_first_lookup(switch: str | None) -> None:
    asked, activated = run_code(FINDER_AFTER, switch=switch).stdout.split()
    assert asked == "1"  # the control (no watcher) and the fixed run alike
    assert activated == ("False" if switch == "0" else "True")


def test_find_spec_alone_activates_nothing_and_the_import_does() -> None:
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('bitsandbytes.nn.parametrize')  # imports its parents\n"
        "print(spec is not None, 'bnb_gc_fix' in sys.modules, 'wrapt' in sys.modules)\n"
        "import bitsandbytes.nn.parametrize\n"
        "print('bnb_gc_fix' in sys.modules)\n"
    )
    assert run_code(code).stdout.split() == ["True", "False", "False", "True"]


LAZY = (
    """
import importlib.util
# The lazy-import recipe of Python's docs (importlib.util.LazyLoader): the import system never loads it.
name = "bitsandbytes.nn.parametrize"
spec = importlib.util.find_spec(name)
loader = importlib.util.LazyLoader(spec.loader)
spec.loader = loader
parametrize = importlib.util.module_from_spec(spec)
sys.modules[name] = parametrize
loader.exec_module(parametrize)
lazy = "bnb_gc_fix" in sys.modules  # nothing of the module has run yet
parametrize.replace_parameter_4bit  # runs it
"""
    + LEAK
    + """
fix = sys.modules.get("bnb_gc_fix")
print(json.dumps({"lazy": lazy, "via": fix and fix.status().via, "counters": steps(quantized.make()),
                  "loader": type(parametrize.__spec__.loader).__name__}))
"""
)


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes (else the control does not leak)")
@pytest.mark.parametrize("switch", [None, "0"])
def test_bitsandbytes_imported_through_lazy_loader_activates_the_fix(switch: str | None) -> None:
    out = run_code(LAZY, prelude="scenarios", switch=switch).last_json
    assert out["lazy"] is False and out["loader"] == "SourceFileLoader"
    if switch is None:
        assert out["via"] == "start-up hook" and out["counters"] == [0, 0, 0]
    else:
        assert out["via"] is None and out["counters"][-1] > out["counters"][0] > 0


HOOK_IN_FRONT = (
    """
from importlib.machinery import PathFinder

class Instrumenting:  # as typeguard's import hook: put first at run time, answers for one package
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "bitsandbytes":
            return PathFinder.find_spec(name, path, target)
        return None

sys.meta_path.insert(0, Instrumenting())
"""
    + LEAK  # imports bitsandbytes, hidden from the start-up hook
    + """
before = quantized.make()
hidden = "bnb_gc_fix" in sys.modules
import bnb_gc_fix
s = bnb_gc_fix.status()
out = {"hidden": hidden, "via": s.via, "state": s.state, "reason": s.reason, "before": steps(before)}
bnb_gc_fix.reset()
out["after"] = steps(quantized.make())  # quantized after the import
print(json.dumps(out))
"""
)


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes (else the control does not leak)")
@pytest.mark.parametrize("switch", [None, "0"])
def test_an_import_hook_in_front_hides_bitsandbytes_and_status_says_so(switch: str | None) -> None:
    out = run_code(HOOK_IN_FRONT, prelude="scenarios", switch=switch).last_json
    assert out["hidden"] is False  # the limit: the start-up hook never saw bitsandbytes' import
    assert out["before"][-1] > 0  # quantized before activation: the plain pair, as status says
    if switch is None:
        assert (out["via"], out["state"]) == ("import", "patched")  # not credited to the start-up hook
        assert "already imported when the fix was activated" in out["reason"]
        assert "bnb_gc_fix.repair(model)" in out["reason"]
        assert out["after"] == [0, 0, 0]
    else:
        assert (out["via"], out["state"]) == (None, "off")
        assert out["after"][-1] > 0


# --- the safety nets never corrupt ----------------------------------------------------------------

# The safety nets around a step (or a failing cell) that runs `step()`; "none" is the control.
STEP_NETS = {
    "none": "def NET():\n    step()\n",
    "guard": "import bnb_gc_fix\ndef NET():\n    with bnb_gc_fix.guard():\n        step()\n",
    "callback": (
        "from bnb_gc_fix.integrations.transformers import LeakGuardCallback\n"
        "def NET():\n"
        "    cb = LeakGuardCallback()\n"
        "    cb.on_step_begin(None, None, None)\n"
        "    step()\n"
        "    cb.on_step_end(None, None, None)\n"
    ),
    "notebook": (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "import bnb_gc_fix\n"
        "assert bnb_gc_fix.status().cell_end_release\n"
        "shell.user_ns['step'] = lambda: step()\n"
        "def NET():\n"
        "    shell.run_cell('step(); undefined_name')  # the cell starts B, then fails\n"
    ),
}


BACKGROUND_HOLD = """
import threading, time, warnings, torch
import torch.nn.utils.parametrize as P
from torch.nn.utils.parametrizations import weight_norm
torch.manual_seed(0)
lin = weight_norm(torch.nn.Linear(8, 8))
x = torch.randn(2, 8)
entered, leave = threading.Event(), threading.Event()

def background():
    with P.cached():  # torch's documented use of the cache, on another thread
        lin(x)
        entered.set()
        leave.wait()

thread = threading.Thread(target=background)
thread.start()
entered.wait()

def step():  # the step does nothing: the other thread's hold was taken before it began
    pass

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    NET()
leave.set()
thread.join()
before = lin(x).clone()
with torch.no_grad():
    lin.parametrizations.weight.original0.mul_(2)  # the magnitude g doubled
after = lin(x)
print(json.dumps({"counter": int(P._cache_enabled), "changed": not torch.equal(before, after),
                  "warnings": [str(w.message) for w in caught if "bnb_gc_fix" in str(w.message)]}))
"""


@pytest.mark.parametrize("net", ["guard", "callback", "notebook"])
def test_safety_nets_never_take_another_threads_live_hold(net: str) -> None:
    control = run_code(STEP_NETS["none"] + BACKGROUND_HOLD, prelude="scenarios").last_json
    assert control == {"counter": 0, "changed": True, "warnings": []}
    fixed = run_code(STEP_NETS[net] + BACKGROUND_HOLD, prelude="scenarios")
    out = fixed.last_json
    assert out["counter"] == 0 and out["changed"] is True  # never -1, never stale weights
    assert out["warnings"] == []
    assert "released" not in fixed.stderr  # and nothing blamed on a cell that did not do it


# Scenario 2 of issue 31: thread B enters torch's P.cached() during thread A's guarded step (or failing
# cell), and is still inside when A's safety net runs. The counter while B is inside, then at the end.
ENTERED_DURING_THE_STEP = """
import threading, warnings, torch
import torch.nn.utils.parametrize as P
entered, leave = threading.Event(), threading.Event()

def background():
    with P.cached():  # torch's documented use of the cache, on another thread
        entered.set()
        leave.wait()

def step():  # the step (or cell) starts B, and ends while B is inside its block
    threading.Thread(target=background, name="B").start()
    entered.wait()

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    NET()
inside = int(P._cache_enabled)
leave.set()
for thread in threading.enumerate():
    if thread.name == "B":
        thread.join()
print(json.dumps({"inside": inside, "end": int(P._cache_enabled),
                  "warnings": [str(w.message) for w in caught if "bnb_gc_fix" in str(w.message)]}))
"""


@pytest.mark.parametrize("net", ["guard", "callback", "notebook"])
def test_safety_nets_leave_a_hold_another_thread_took_during_the_step(net: str) -> None:
    control = run_code(STEP_NETS["none"] + ENTERED_DURING_THE_STEP, prelude="scenarios").last_json
    assert control == {"inside": 1, "end": 0, "warnings": []}
    fixed = run_code(STEP_NETS[net] + ENTERED_DURING_THE_STEP, prelude="scenarios")
    out = fixed.last_json
    assert (out["inside"], out["end"]) == (1, 0)  # B's hold kept while B is inside; never -1 after
    said = out["warnings"] if net != "notebook" else [fixed.stderr]
    assert len(said) == 1 and "1 holds that no call of this thread accounts for" in said[0], fixed.stderr
    assert "stay in place: other threads are running" in said[0]


GUARDED_INTERRUPT = """
import warnings, torch, threading
import torch.nn.utils.parametrize as P
import quantized, bnb_gc_fix
bnb_gc_fix.deactivate()  # a plain pair: the hold a KeyboardInterrupt leaves stays stuck
module = quantized.make(params=1)
x = torch.randn(4, 64)
P._cache_enabled += 1  # a hold taken before the step (a P.cached() kept open): not the step's
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with bnb_gc_fix.guard():
        quantized.interrupted_forward(module, x)
leaks = [str(w.message) for w in caught if isinstance(w.message, bnb_gc_fix.CacheLeakWarning)]
print(json.dumps({"counter": quantized.counter(), "warnings": leaks}))
"""


def test_guard_releases_only_what_the_step_added() -> None:
    out = run_code(GUARDED_INTERRUPT, prelude="scenarios").last_json
    assert out["counter"] == 1  # the step's stuck hold released, the earlier one kept
    [message] = out["warnings"]
    assert "went from 1 to 2 during the step" in message and "released 1 holds" in message


COMPILED_GUARDED = """
import torch, bnb_gc_fix
def step(x):
    return (x * 2).sum()
outside = bnb_gc_fix.guard()(torch.compile(step, fullgraph=True, backend="eager"))
inside = torch.compile(bnb_gc_fix.guard()(step), backend="eager")  # the guard's frame runs uncompiled
print(float(outside(torch.ones(3))), float(inside(torch.ones(3))))
"""


@pytest.mark.skipif(not AFFECTED, reason="compares with the auto run on an affected bitsandbytes")
def test_a_compiled_step_guarded_from_outside_even_with_fullgraph() -> None:
    for switch in (None, "0"):
        assert run_code(COMPILED_GUARDED, switch=switch).stdout.split()[-2:] == ["6.0", "6.0"]


# --- repair() honours force -----------------------------------------------------------------------

REPAIR_FORCE = """
import torch
import bnb_gc_fix, quantized
bnb_gc_fix.deactivate()
module = quantized.make()  # quantized while the fix is off: bitsandbytes' own pair
bnb_gc_fix.activate()
repaired = bnb_gc_fix.repair(module)
x = torch.randn(4, 64)
stuck = quantized.interrupted_forward(module, x)  # a caught Ctrl-C
module(x)
print(json.dumps({"bitsandbytes": __import__("bitsandbytes").__version__, "repaired": repaired,
                  "stuck": stuck, "after": quantized.counter()}))
"""


@pytest.mark.downloads
@pytest.mark.parametrize("switch", ["force", None])
def test_repair_honours_force_on_a_fixed_bitsandbytes(switch: str | None) -> None:
    env = environment(switch, PYTHONPATH=str(pip_target("bitsandbytes==0.50.2")))
    out = run_code(REPAIR_FORCE, prelude="scenarios", env=env).last_json
    assert out["bitsandbytes"] == "0.50.2" and out["stuck"] == 1
    if switch == "force":
        assert out["repaired"] == 1 and out["after"] == 0  # the gate heals the Ctrl-C
    else:
        assert out["repaired"] == 0 and out["after"] == 1  # the control: upstream's pair stays stuck
