"""The ``bnb-gc-fix`` command line, as a user meets it: every path of ``check`` ends with its documented
exit code (0 protected, 1 leak, 2 cannot run) and, with ``--json``, one JSON object; the leak's two faces
(the cache left on, torch's CheckpointError) beside their controls; ``status`` renders
``bnb_gc_fix.status()`` with each sentence once, in the words ``check`` uses; messages name no internals."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import (
    AFFECTED,
    BITSANDBYTES,
    TORCH,
    WITHOUT_STARTUP_HOOK,
    cli_calls,
    command,
    environment,
    pip_target,
    run_code,
    run_python,
    unwrapped,
)

INTERNALS = ("Traceback", "CannotRunError", "_positive", "command_name", "_cmd_", "b'/", "bnb_gc_fix.")

# --- every path of `check` ----------------------------------------------------------------------

# One interpreter per path: its setup code sets the path up for real (an import blocked by a meta-path
# finder, a CPU-only torch asked for CUDA, ...), then `check --json` and `check` both run in it.

# A library that cannot be imported here, as where it is not installed: its modules forgotten, with those
# of the libraries that need it (a warm process imported them all), and a finder that answers "no such
# module" for it.
_BLOCK = """
import sys
for imported in [each for each in sys.modules if each.split(".")[0] in {forgotten!r}]:
    del sys.modules[imported]
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r} or name.startswith({name!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def blocked(name: str) -> str:
    """Setup code for a process where ``name`` cannot be imported."""
    top = name.split(".")[0]
    needs = {"torch": ("torch", "bitsandbytes", "transformers")}.get(top, (top,))
    forgotten = needs if name == top else ()
    return _BLOCK.format(name=name, forgotten=forgotten)


PATHS = {
    # CUDA asked for on this machine's CPU-only torch build.
    "cuda-on-cpu-only-torch": ("", ["--device", "cuda"], "a build without CUDA support"),
    # A CUDA build of torch on a machine without a usable device (the build flag set, no device).
    "cuda-build-without-device": (
        "import torch; torch.version.cuda = '12.4'\n",
        ["--device", "cuda"],
        "no CUDA device is available",
    ),
    "torch-missing": (blocked("torch"), [], "torch is not installed; install torch"),
    "torch-too-old": ("import torch; torch.__version__ = '2.0.1'\n", [], "torch 2.0.1 is too old"),
    "bitsandbytes-missing": (
        blocked("bitsandbytes"),
        [],
        "bitsandbytes is not installed; install bitsandbytes to run the check (bitsandbytes >= 0.48.0)",
    ),
    "bitsandbytes-too-old": (
        blocked("bitsandbytes.nn.parametrize") + "import bitsandbytes; bitsandbytes.__version__ = '0.47.0'\n",
        [],
        "bitsandbytes 0.47.0 has no bitsandbytes.nn.parametrize",
    ),
    # A register function whose hook function is gone: its code does not say plainly what it registers, so
    # the fix stays out (its one warning ignored here), and bitsandbytes' own quantization fails inside the
    # check's model.
    "unexpected-internals": (
        WITHOUT_STARTUP_HOOK
        + "import warnings; warnings.simplefilter('ignore')\n"
        + "from bitsandbytes.nn import parametrize\n"
        + "del parametrize._disable_parametrization_cache\n",
        [],
        "the check's small model failed",
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
    setup, extra, message = PATHS[path]
    args = ["check", "--steps", "2", *extra]
    (json_code, json_out, _), (text_code, text_out, text_err) = cli_calls(
        [*args, "--json"], args, setup=setup
    )
    assert json_code == text_code == 2, (json_out, text_err)
    [payload_line] = json_out.splitlines()  # exactly one line, one object
    payload = json.loads(payload_line)
    assert payload_line == json.dumps(payload, sort_keys=True)  # the one JSON style
    assert payload["exit_code"] == 2 and payload["protected"] is None and payload["steps"] == []
    assert message in payload["error"]
    assert text_out == "" and text_err.startswith("bnb-gc-fix check: cannot run: ")
    assert message in unwrapped(text_err) and max(len(line) for line in text_err.splitlines()) <= 100
    for word in INTERNALS:
        assert word not in text_err + payload["error"], word
    if path == "unexpected-internals":  # the hooks cannot be read: status says so, and the fix is not in
        status = payload["status"]
        [bitsandbytes] = [each for each in status["libraries"] if each["name"] == "bitsandbytes"]
        assert bitsandbytes["hooks"] == "cannot be read" and status["fixed"] is False
        # The check's half-quantized module counts while it is alive (a reference cycle until collected).
        assert status["state"] == ("unprotected" if bitsandbytes["leaking"] else "not affected")
        unreadable = (
            "the fix could not be put in: bnb-gc-fix cannot read its hooks (the code of "
            "bitsandbytes.nn.parametrize._register_parametrization_hooks() does not say plainly what it "
            "registers); `bnb-gc-fix check` shows whether they leak"
        )
        assert unreadable in unwrapped(status["reason"]), status["reason"]


def test_check_cuda_on_this_cpu_only_torch_from_the_console_script() -> None:
    """The reported symptom itself: a traceback and exit 1 (read by CI as a leak)."""
    console = str(Path(sys.executable).parent / "bnb-gc-fix")
    fresh = "the console script itself, as the symptom was reported"
    result = run_python(["check", "--device", "cuda", "--json"], executable=console, fresh=fresh)
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
    "json-steps-0": call(["check", "--json", "--steps", "0"]),
    "json-device-tpu": call(["check", "--json", "--device", "tpu"]),
    "no-such-command": call(["run", "--", "train.py"]),
    "torch-imported": "torch" in __import__("sys").modules,
}))
"""


def test_command_line_messages_are_clear_and_name_no_internals() -> None:
    outcome = json.loads(run_code(CLI_PATHS, fresh="a usage error imports no torch").stdout)
    code, text = outcome["no-arguments"]
    assert code == 2 and "usage: bnb-gc-fix" in text and "give a command" in text
    code, text = outcome["steps-abc"]
    assert code == 2 and "'abc' is not a whole number" in text and "invalid" not in text
    code, text = outcome["steps-0"]
    assert code == 2 and "must be at least 1" in text
    code, text = outcome["device-tpu"]
    assert code == 2 and "invalid choice: 'tpu'" in text
    for case, needle in (("json-steps-0", "must be at least 1"), ("json-device-tpu", "invalid choice")):
        code, text = outcome[case]
        [line] = text.splitlines()  # one JSON object on stdout, even for an argparse error; nothing else
        report = json.loads(line)
        assert code == report["exit_code"] == 2 and needle in report["error"] and report["protected"] is None
    code, text = outcome["no-such-command"]  # `run` is gone: argparse names the choices
    assert code == 2 and "invalid choice: 'run'" in text and "choose from" in text
    for _, text in (v for k, v in outcome.items() if k != "torch-imported"):
        for word in INTERNALS:
            assert word not in text, (word, text)
    assert outcome["torch-imported"] is False


# --- check -------------------------------------------------------------------------------------


# `bnb-gc-fix check --device cpu` (the README's command) and its --json, with the fix on and off: each run
# once, read by these tests and by the README's console block (test_readme.py).


@pytest.mark.stack
def test_check_exits_0_when_protected() -> None:
    code, out, err = command("check", "--device", "cpu")
    assert code == 0, err
    lines = out.splitlines()
    state = "protected" if AFFECTED else "not affected"
    assert lines[1].startswith(f"state: {state}: ")
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert rows == [["1", "0", "0"], ["2", "0", "0"], ["3", "0", "0"], ["4", "0", "0"]]
    assert "an adapter trained through the quantized experts: 4 steps ran" in lines
    assert lines[-1].startswith(f"{state}: ") and "CheckpointError" not in out


@pytest.mark.stack
def test_check_control_exits_1_when_switched_off_and_shows_both_faces_of_the_leak() -> None:
    text_code, text, _ = command("check", "--device", "cpu", switch="0")
    json_code, line, err = command("check", "--device", "cpu", "--json", switch="0")
    payload = json.loads(line)
    if not AFFECTED:  # upstream's fix holds without the package
        assert json_code == text_code == 0, err
        assert payload["protected"] is True and payload["state"] == "not affected"
        assert text.splitlines()[-1].startswith("not affected: ") and "nothing was needed" in unwrapped(text)
        return
    assert json_code == text_code == 1, err
    assert payload["protected"] is False and payload["status"]["state"] == "unprotected"
    counters = [s["counter"] for s in payload["steps"]]
    assert len(counters) == 4 and counters[0] > 0 and counters == sorted(counters)
    assert all(s["cache_bytes"] > 0 for s in payload["steps"])
    assert payload["adapter_steps"] == 0 and payload["adapter_error"].startswith("CheckpointError: ")
    said = unwrapped(text)
    assert "an adapter trained through the quantized experts: step 1 died: CheckpointError: " in said
    assert "LEAK: the cache stayed switched on after a step" in said
    assert "the CheckpointError comes from the same leak" in said


def test_check_json_matches_its_table() -> None:
    _, table, _ = command("check", "--device", "cpu", switch="0")
    _, data, _ = command("check", "--device", "cpu", "--json", switch="0")
    rows = [[int(v) for v in line.split()] for line in table.splitlines() if line.strip()[:1].isdigit()]
    payload = json.loads(data)
    assert rows == [[s["step"], s["counter"], s["cache_bytes"]] for s in payload["steps"]]
    assert payload["device"] == "cpu"


# --- the `status` command on this stack ----------------------------------------------------------


#: The command's closing notes: a job that uses BitsAndBytesConfig alone, and where its answer comes from.
LAYERS_ALONE = (
    "note: a job here that uses BitsAndBytesConfig alone (load_in_4bit or load_in_8bit) is not affected: "
    "its Linear4bit and Linear8bitLt layers never use this cache"
)
READ_FROM_THE_CODE = (
    "note: this comes from reading the libraries' code, not from a job; in your job, "
    "print(bnb_gc_fix.status()) after a training step"
)


@pytest.mark.stack
def test_status_command_and_its_json_on_this_stack() -> None:
    (text_code, text, _), (json_code, line, err) = cli_calls(["status"], ["status", "--json"])
    assert text_code == json_code == 0, err
    # The JSON: one object on one line, keys sorted (check --json's style).
    [line] = line.splitlines()
    facts = json.loads(line)
    assert line == json.dumps(facts, sort_keys=True)
    # Issues 51 and 54: it answers for the environment, what a job here that quantizes with
    # replace_parameter_4bit gets, from the library's code; this command's own process quantizes nothing.
    bitsandbytes = facts["libraries"][0]
    assert bitsandbytes["name"] == "bitsandbytes" and bitsandbytes["version"] == BITSANDBYTES
    hooks = "leak this way" if AFFECTED else "do not leak this way"
    assert bitsandbytes["hooks"] == hooks and bitsandbytes["fixed"] is AFFECTED is facts["fixed"]
    assert facts["state"] == bitsandbytes["state"] == ("protected" if AFFECTED else "not affected")
    assert facts["reason"] == bitsandbytes["reason"]
    assert facts["process"]["state"] == "not affected" and facts["process"]["covered"] == 0
    assert facts["process"]["counter"] == 0 and facts["process"]["cache_bytes"] == 0
    assert str(TORCH) == facts["torch"]
    # The command's own import of the package asked for the fix: asked for, and whether it went in, are
    # two facts (there is no "on").
    assert facts["asked_by"] == facts["process"]["asked_by"] == "import bnb_gc_fix" and "on" not in facts
    assert facts["switch"] is None and facts["import_errors"] == []
    for key in ("python", "transformers", "reason", "bnb_gc_fix"):
        assert facts[key]
    # The text: the same record, each fact once: versions, state, fix, where it comes from.
    said = unwrapped(text)
    lines = text.splitlines()
    assert lines[0].startswith("bnb-gc-fix ") and f"torch {TORCH}" in lines[0]
    assert f"bitsandbytes {BITSANDBYTES}" in lines[0]
    # Nothing here is imported from elsewhere than installed: no "(installed: ...)", a CUDA build of torch
    # from PyPI included (its __version__ 2.15.0+cu132, its metadata 2.15.0: the nox cells newest, latest).
    assert "(installed: " not in lines[0], lines[0]
    assert f"state: {facts['state']}: {facts['reason']}" in said
    everywhere = "(BNB_GC_FIX unset); the start-up hook does the same in every process here"
    if AFFECTED:
        job = "the fix covers the modules a job here quantizes with replace_parameter_4bit"
        assert f"state: protected: {job} fix: in bitsandbytes {BITSANDBYTES}'s hooks {everywhere}" in said
    else:  # asked for, and not needed: bitsandbytes' own hooks switch the cache off; nothing goes in
        said_of_it = f"the hooks of bitsandbytes {BITSANDBYTES} do not leak this way (BNB_GC_FIX unset)"
        assert f"fix: not needed here: {said_of_it}" in said and everywhere not in said
    assert said.count(facts["reason"]) == 1 and not any(line.startswith("cache:") for line in lines)
    assert not [line for line in lines if line.startswith(("bitsandbytes", "axolotl"))]  # no library line
    assert said.endswith(f"{LAYERS_ALONE} {READ_FROM_THE_CODE}")


@pytest.mark.parametrize("switch", [None, "0"], ids=["fix on", "switched off"])
def test_status_command_tells_a_bitsandbytesconfig_alone_reader_they_are_not_affected(
    switch: str | None,
) -> None:
    """Issue 54's finding 5: a QLoRA user (BitsAndBytesConfig alone) read `state: protected` as a risk to
    their setup. The state line says it answers for a job that quantizes with replace_parameter_4bit, and
    a note says a job with BitsAndBytesConfig alone is not affected, with the fix on or off."""
    [(code, text, err)] = cli_calls(["status"], switch=switch)
    assert code == 0, err
    said = unwrapped(text)
    [state] = [unwrapped(each) for each in re.split(r"\n(?=\S)", text) if each.startswith("state:")]
    job = "the modules a job here quantizes with replace_parameter_4bit"
    if not AFFECTED:
        assert state.startswith("state: not affected: ") and f"bitsandbytes {BITSANDBYTES}'s hooks" in state
    elif switch is None:
        assert state == f"state: protected: the fix covers {job}", state
    else:  # the control: such a job leaks; one with BitsAndBytesConfig alone still does not
        assert state.startswith(f"state: unprotected: {job} leak this way: the fix is off"), state
    assert LAYERS_ALONE in said and said.count("BitsAndBytesConfig") == 1


def test_status_command_with_the_switch_off_says_what_a_job_here_gets() -> None:
    """Issue 51: with BNB_GC_FIX=0 every job here that quantizes with replace_parameter_4bit leaks on an
    affected release, and the command says so, with what the library's hooks do (8dd19c6: `not affected`,
    and `"affected": null` in the JSON)."""
    (_, text, _), (_, line, _) = cli_calls(["status"], ["status", "--json"], switch="0")
    facts = json.loads(line)
    bitsandbytes = facts["libraries"][0]
    assert bitsandbytes["hooks"] == ("leak this way" if AFFECTED else "do not leak this way")
    assert bitsandbytes["fixed"] is facts["fixed"] is False and facts["asked_by"] is None
    assert facts["state"] == ("unprotected" if AFFECTED else "not affected")
    if AFFECTED:
        job = "the modules a job here quantizes with replace_parameter_4bit leak this way"
        off = "the fix is off (BNB_GC_FIX='0'; unset it to turn the fix on)"
        assert f"state: unprotected: {job}: {off}" in unwrapped(text)
    assert "fix: off (BNB_GC_FIX='0') note:" in unwrapped(text)


# Issue 54, "One verdict": status() and `bnb-gc-fix status` are one function over one set of facts. In one
# process that quantized a module with replace_parameter_4bit and trained a checkpointed step, status()
# says of that module what the command says of a job that quantizes with it: the same state in the same
# words, and the same fix line. On bitsandbytes 0.50.2 (hooks that do not leak), the fix on or off, both
# say "not affected" for the same reason (d75b8f8's status() read that as a risk: "would run without the
# fix: the fix is off").
ONE_VERDICT = """
import contextlib, io
import bnb_gc_fix, quantized
from bnb_gc_fix.cli import main
model = quantized.make(params=1)  # alive while both answer: status() counts it
quantized.checkpointed_counters(model, steps=1)
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["status"])
s = bnb_gc_fix.status()
print(json.dumps({"process": [s.state_line(), s.fix_line(everywhere=True)], "command": out.getvalue()}))
"""


def _as_a_jobs(line: str) -> str:
    """What status() says of the module it counts, said of a job's modules, as the command says it."""
    quantized = "1 module quantized here with replace_parameter_4bit"
    job = "the modules a job here quantizes with replace_parameter_4bit"
    return line.replace(f"{quantized} leaks", f"{job} leak").replace(quantized, job)


@pytest.mark.parametrize(
    ("release", "switch"),
    [("installed", None), ("installed", "0"), ("0.50.2", None), ("0.50.2", "0")],
    ids=["installed", "installed BNB_GC_FIX=0", "0.50.2", "0.50.2 BNB_GC_FIX=0"],
)
def test_status_and_the_status_command_give_the_same_state_in_the_same_words(
    release: str, switch: str | None
) -> None:
    if release == "installed":
        run = run_code(ONE_VERDICT, prelude="scenarios", switch=switch)
        version = BITSANDBYTES
    else:
        env = environment(switch, PYTHONPATH=str(pip_target(f"bitsandbytes=={release}")))
        run = run_code(
            ONE_VERDICT, prelude="scenarios", env=env, fresh=f"bitsandbytes {release} on PYTHONPATH"
        )
        version = release
    seen = run.last_json
    state, fix = (unwrapped(line) for line in seen["process"])
    command = [unwrapped(each) for each in re.split(r"\n(?=\S)", seen["command"])]
    assert command[1:3] == [_as_a_jobs(state), fix], (seen["process"], seen["command"])
    if release == "0.50.2" or not AFFECTED:
        assert state.startswith(f"state: not affected: bitsandbytes {version}'s hooks switch the cache off")
    elif switch is None:
        assert state == "state: protected: the fix covers 1 module quantized here with replace_parameter_4bit"
    else:
        assert state.startswith("state: unprotected: 1 module quantized here with replace_parameter_4bit")


# A source checkout of bitsandbytes first on PYTHONPATH over the installed release (issue 51): the
# versions line names the bitsandbytes imported, and the installed metadata's version beside it. The
# checkout is the installed package's files, linked, with an __init__.py that says another __version__.
CHECKOUT_VERSION = "0.50.0.dev0"


def _checkout_of_bitsandbytes(folder: Path) -> Path:
    """``folder``, holding a ``bitsandbytes`` package: the installed one's files linked, its own
    ``__init__.py`` saying ``__version__ = CHECKOUT_VERSION``."""
    spec = importlib.util.find_spec("bitsandbytes")  # a top-level package's spec imports nothing
    assert spec is not None and spec.submodule_search_locations
    installed = Path(next(iter(spec.submodule_search_locations)))
    init = installed / "__init__.py"

    def link(source: str, target: str) -> None:
        if Path(source) == init:
            shutil.copy(source, target)
        else:
            os.symlink(source, target)

    package = folder / "bitsandbytes"
    shutil.copytree(installed, package, ignore=shutil.ignore_patterns("__pycache__"), copy_function=link)
    text, said = init.read_text(), f'__version__ = "{BITSANDBYTES}"'
    assert said in text
    (package / "__init__.py").write_text(text.replace(said, f'__version__ = "{CHECKOUT_VERSION}"'))
    return folder


@pytest.mark.skipif(BITSANDBYTES is None, reason="needs bitsandbytes installed, to put a checkout over it")
@pytest.mark.parametrize("where", ["a checkout first on PYTHONPATH", "the plain environment"])
def test_status_versions_line_names_the_bitsandbytes_imported(tmp_path: Path, where: str) -> None:
    if where == "the plain environment":  # the control: one version named, the installed one
        (_, text, err), (_, line, _) = cli_calls(["status"], ["status", "--json"])
        imported = BITSANDBYTES
        named = f"bitsandbytes {BITSANDBYTES}"
    else:
        env = environment(None, PYTHONPATH=str(_checkout_of_bitsandbytes(tmp_path)))
        fresh = "another PYTHONPATH: a checkout of bitsandbytes over the installed release"
        (_, text, err), (_, line, _) = cli_calls(["status"], ["status", "--json"], env=env, fresh=fresh)
        imported = CHECKOUT_VERSION
        named = f"bitsandbytes {CHECKOUT_VERSION} (installed: {BITSANDBYTES})"
    first = unwrapped(text.split("\nstate: ")[0])
    assert f"{named}," in f"{first},", (first, err)
    assert first.count("bitsandbytes") == 1 and first.count("installed") == named.count("installed")
    facts = json.loads(line)
    assert facts["bitsandbytes"] == BITSANDBYTES and facts["imported"]["bitsandbytes"] == imported
    assert facts["libraries"][0]["version"] == imported  # the verdict's version is the first line's
    assert max(len(each) for each in text.splitlines()) <= 100


def test_status_command_without_torch_says_so() -> None:
    code = blocked("torch") + "from bnb_gc_fix.cli import main\nraise SystemExit(main(['status']))"
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr
    said = unwrapped(result.stdout)
    assert "state: not affected: bitsandbytes cannot be imported here" in said
    assert "import: torch is not installed" in said


def test_status_command_without_bitsandbytes_says_so() -> None:
    status_command = "from bnb_gc_fix.cli import main\nraise SystemExit(main(['status']))"
    code = blocked("bitsandbytes") + status_command
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr
    said = unwrapped(result.stdout)
    assert "state: not affected: bitsandbytes cannot be imported here" in said
    assert "import: bitsandbytes is not installed" in said
    assert "not imported here" not in said  # issue 42's finding 8
