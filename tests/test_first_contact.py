"""Issue 9: what a newcomer meets first. Every path of ``check`` ends with its documented exit code
and one JSON object; status reads as protection (state, counter, cache bytes); the command line
names no internals; warnings point at the user's line; the README's commands and real output
cannot drift from CI (the last two tests read files only)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS, WITHOUT_STARTUP_HOOK, run_code, run_python

sys.path.insert(0, str(ROOT / "scripts"))
import readme_table

# Words a user must never meet: our own identifiers and Python's internals.
INTERNALS = ("Traceback", "CannotRunError", "_positive", "command_name", "_cmd_", "b'/", "bnb_gc_fix.")

# --- every path of `check` ----------------------------------------------------------------------

# One interpreter per path: a prelude sets the path up for real (an import blocked by a meta-path
# finder, a CPU-only torch asked for CUDA, ...), then `check --json` and `check` both run in it.
CHECK_BOTH_WAYS = """
import contextlib, io, json, sys
from bnb_gc_fix.cli import main
def call(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return [code, out.getvalue(), err.getvalue()]
ARGS = ["check", "--steps", "2"] + EXTRA
print("RESULT " + json.dumps([call(ARGS + ["--json"]), call(ARGS)]))
"""

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r} or name.startswith({name!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""

PATHS = {
    # CUDA asked for on this machine's CPU-only torch build.
    "cuda-on-cpu-only-torch": ("", ["--device", "cuda"], "without CUDA support"),
    # A CUDA build of torch on a machine without a usable device (the build flag set, no device).
    "cuda-build-without-device": (
        "import torch; torch.version.cuda = '12.4'\n",
        ["--device", "cuda"],
        "no CUDA device is available",
    ),
    "torch-missing": (BLOCK.format(name="torch"), [], "torch is not installed; install torch"),
    "torch-too-old": ("import torch; torch.__version__ = '2.0.1'\n", [], "torch 2.0.1 is too old"),
    "bitsandbytes-missing": (BLOCK.format(name="bitsandbytes"), [], "install bitsandbytes>=0.48"),
    "bitsandbytes-too-old": (
        BLOCK.format(name="bitsandbytes.nn.parametrize")
        + "import bitsandbytes; bitsandbytes.__version__ = '0.47.0'\n",
        [],
        "bitsandbytes 0.47.0 has no bitsandbytes.nn.parametrize",
    ),
    # Internals the fix does not expect: the fix skips (one warning) and bitsandbytes' own
    # quantization then fails inside the synthetic run.
    "unexpected-internals": (
        WITHOUT_STARTUP_HOOK
        + "import warnings; warnings.simplefilter('ignore')\n"
        + "from bitsandbytes.nn import parametrize\n"
        + "del parametrize._disable_parametrization_cache\n",
        [],
        "the synthetic model failed",
    ),
    "exception-in-the-run": (
        "import torch.utils.checkpoint as c\n"
        "def broken(*args, **kwargs): raise RuntimeError('simulated failure')\n"
        "c.checkpoint = broken\n",
        [],
        "RuntimeError: simulated failure",
    ),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_every_check_path_exits_2_with_one_json_object(path: str) -> None:
    prelude, extra, message = PATHS[path]
    result = run_code(prelude + CHECK_BOTH_WAYS.replace("EXTRA", repr(extra)))
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    (json_code, json_out, _), (text_code, text_out, text_err) = json.loads(line[len("RESULT ") :])
    assert json_code == text_code == 2, (json_out, text_err)
    [payload_line] = json_out.splitlines()  # exactly one line, one object
    payload = json.loads(payload_line)
    assert payload_line == json.dumps(payload, sort_keys=True)  # the one JSON style
    assert payload["exit_code"] == 2 and payload["protected"] is None and payload["steps"] == []
    assert message in payload["error"]
    assert text_out == "" and text_err.startswith("bnb-gc-fix check: cannot run: ") and message in text_err
    for word in INTERNALS:
        assert word not in text_err + payload["error"], word
    if path == "unexpected-internals":
        assert payload["status"]["state"] == "skipped" and payload["status"]["active"] is False


def test_check_cuda_on_this_cpu_only_torch_from_the_console_script() -> None:
    """The reported symptom itself: a traceback and exit 1 (read by CI as a leak)."""
    console = str(Path(sys.executable).parent / "bnb-gc-fix")
    result = run_python(["check", "--device", "cuda", "--json"], executable=console)
    assert result.returncode == 2
    assert json.loads(result.stdout)["exit_code"] == 2
    assert "Traceback" not in result.stderr


# --- the smaller command-line paths (no torch needed: one interpreter) --------------------------

CLI_PATHS = """
import contextlib, io, json
from bnb_gc_fix.cli import main
def call(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exit:
            code = exit.code
    return [code, out.getvalue() + err.getvalue()]
print(json.dumps({
    "no-arguments": call([]),
    "steps-abc": call(["check", "--steps", "abc"]),
    "steps-0": call(["check", "--steps", "0"]),
    "device-tpu": call(["check", "--device", "tpu"]),
    "no-such-command": call(["run", "--", "no-such-cmd-bnb-gc-fix"]),
    "run-nothing": call(["run"]),
    "torch-imported": "torch" in __import__("sys").modules,
}))
"""


def test_command_line_messages_are_clear_and_name_no_internals() -> None:
    outcome = json.loads(run_code(CLI_PATHS).stdout)
    code, text = outcome["no-arguments"]
    assert code == 2 and "usage: bnb-gc-fix" in text and "give a command" in text
    code, text = outcome["steps-abc"]
    assert code == 2 and "'abc' is not a whole number" in text and "invalid" not in text
    code, text = outcome["steps-0"]
    assert code == 2 and "must be at least 1" in text
    code, text = outcome["device-tpu"]
    assert code == 2 and "invalid choice: 'tpu'" in text
    code, text = outcome["no-such-command"]  # like a shell: 127, naming the command
    assert code == 127 and text.strip() == "bnb-gc-fix run: no-such-cmd-bnb-gc-fix: command not found"
    code, text = outcome["run-nothing"]
    assert code == 2 and "no command given" in text
    for _, text in (v for k, v in outcome.items() if k != "torch-imported"):
        for word in INTERNALS:
            assert word not in text, (word, text)
    assert outcome["torch-imported"] is False


# --- status reads as protection -----------------------------------------------------------------

# One interpreter walks a user's script: status at the top, after `import bitsandbytes`, after the
# model is quantized, after a leaking step with the fix switched off, and back on. The INFO log
# line is checked in the same run (the package's one INFO line when it patches).
STATES = (
    WITHOUT_STARTUP_HOOK
    + f"""
import json, logging, sys
sys.path.insert(0, {str(SCENARIOS)!r})
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s: %(message)s")
import bnb_gc_fix
def show():
    s = bnb_gc_fix.status()
    return dict(state=s.state, active=s.active, counter=s.counter, cache_bytes=s.cache_bytes,
                reason=s.reason, torch_imported="torch" in sys.modules)
seen = {{"top": show()}}
import bitsandbytes
seen["after import bitsandbytes"] = show()
import torch
from torch.utils.checkpoint import checkpoint
import quantized
module = quantized.quantize(quantized.Quantized(params=2))
seen["quantized"] = show()
x = torch.randn(2, 64)
checkpoint(module, x, use_reentrant=False).sum().backward()
seen["step"] = show()
bnb_gc_fix.deactivate()
off = quantized.quantize(quantized.Quantized(params=2))
checkpoint(off, x, use_reentrant=False).sum().backward()
seen["off, leaking step"] = show()
bnb_gc_fix.reset()
bnb_gc_fix.activate()
seen["on again"] = show()
print("STATES " + json.dumps(seen))
"""
)


def test_status_state_counter_and_cache_bytes_through_a_script() -> None:
    result = run_code(STATES)
    seen = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("STATES "))[7:])
    top = seen["top"]
    assert top["state"] == "armed" and top["active"] is False  # `active` keeps its meaning
    assert top["reason"].startswith("armed: ") and "when a model is quantized" in top["reason"]
    assert top["counter"] is None and top["cache_bytes"] is None and top["torch_imported"] is False
    # bitsandbytes 0.49.2 does not import its parametrize module by itself: still armed, not failed.
    assert seen["after import bitsandbytes"]["state"] == "armed"
    assert seen["after import bitsandbytes"]["counter"] == 0  # torch (and its parametrize) imported now
    assert seen["quantized"]["state"] == "patched" and seen["quantized"]["active"] is True
    assert seen["step"]["counter"] == 0 and seen["step"]["cache_bytes"] == 0
    leaking = seen["off, leaking step"]
    assert leaking["state"] == "off" and leaking["counter"] > 0 and leaking["cache_bytes"] > 0  # control
    assert seen["on again"]["state"] == "patched" and seen["on again"]["counter"] == 0
    logs = [line for line in result.stdout.splitlines() if line.startswith("LOG ")]
    assert any(line.startswith("LOG bnb_gc_fix: bitsandbytes 0.49.2 is in") for line in logs), logs
    assert not any("bnb_gc_fix: bnb_gc_fix" in line for line in logs), logs


def test_status_switched_off_by_the_environment_says_off() -> None:
    code = "import bnb_gc_fix, json; s = bnb_gc_fix.status(); print(json.dumps([s.state, s.active]))"
    assert json.loads(run_code(code, switch="0").stdout) == ["off", False]


def test_status_command_says_each_sentence_once() -> None:
    result = run_python(["-m", "bnb_gc_fix", "status"])
    assert result.returncode == 0
    out = result.stdout
    lines = out.splitlines()
    assert "state:            patched, turned on by the start-up hook" in lines
    assert "cache counter:    0" in lines and "cache bytes:      0" in lines
    whys = [line.split(":", 1)[1].strip() for line in lines if line.strip().startswith("why:")]
    assert len(whys) == 1 and out.count(whys[0]) == 1


def test_status_command_without_torch_reads_armed() -> None:
    code = BLOCK.format(name="torch") + "from bnb_gc_fix.cli import main\nraise SystemExit(main(['status']))"
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    lines = out.splitlines()
    assert "state:            armed, turned on by the start-up hook" in lines
    assert "torch:            (not installed)" in lines
    assert "cache counter:    - (torch's parametrization module is not imported)" in lines
    assert any(line.startswith("  why:            torch is not installed") for line in lines), out
    whys = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("why:")]
    assert len(set(whys)) == len(whys)


# --- warnings point at the user's line ----------------------------------------------------------

WARN_PATHS = {
    "import": (WITHOUT_STARTUP_HOOK + "import bnb_gc_fix  # USER LINE\n"),
    "activate()": (
        WITHOUT_STARTUP_HOOK
        + "import os\nos.environ['BNB_GC_FIX'] = 'auto'\nimport bnb_gc_fix\nbnb_gc_fix.deactivate()\n"
        + "os.environ['BNB_GC_FIX'] = 'sometimes'\nbnb_gc_fix.activate()  # USER LINE\n"
    ),
    "start-up hook": "import bitsandbytes  # USER LINE\n",
    "patch skipped": (
        WITHOUT_STARTUP_HOOK
        + "from bitsandbytes.nn import parametrize\ndel parametrize._disable_parametrization_cache\n"
        + "import bnb_gc_fix  # USER LINE\n"
    ),
}


@pytest.mark.parametrize("path", list(WARN_PATHS))
def test_warnings_point_at_the_users_line(path: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(WARN_PATHS[path])
    lines = script.read_text().splitlines()
    line = 1 + lines.index(next(s for s in lines if s.endswith("# USER LINE")))
    switch = None if path == "patch skipped" else "sometimes"
    result = run_python([str(script)], switch=switch)
    assert result.returncode == 0, result.stderr
    expected = (
        f"{script}:{line}: PatchSkippedWarning: bnb-gc-fix is not active"
        if path == "patch skipped"
        else f"{script}:{line}: SwitchValueWarning: BNB_GC_FIX='sometimes'"
    )
    assert expected in result.stderr, result.stderr


# --- the README's commands and real output (files only; CI regenerates the output) ---------------


def test_ci_runs_the_readme_quick_start_commands_exactly() -> None:
    readme, ci = readme_table.quick_start_commands(), readme_table.ci_commands()
    assert readme and readme == ci, (readme, ci)


def test_readme_examples_are_generated_console_blocks() -> None:
    blocks = readme_table.console_blocks((ROOT / "README.md").read_text())
    assert {"check-output", "status-output", "api-output"} <= set(blocks)
    for name, commands in blocks.items():
        assert commands, name
        assert all(re.match(r"^[A-Za-z_=0-9 ]*(bnb-gc-fix|python|echo)\b", c) for c in commands), commands
