"""Issue 4: the ``bnb-gc-fix`` CLI (status, check), the leak guard, and the Trainer callback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import AFFECTED, BITSANDBYTES, SCENARIOS, TORCH, run_code, run_python, tiny_olmoe

# --- check -------------------------------------------------------------------------------------


@pytest.mark.stack
def test_check_exits_0_when_protected() -> None:
    result = run_python(["-m", "bnb_gc_fix", "check", "--device", "cpu", "--steps", "3"])
    assert result.returncode == 0, result.stderr
    assert "protected" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [["1", "0", "0"], ["2", "0", "0"], ["3", "0", "0"]]


@pytest.mark.stack
def test_check_control_exits_1_when_switched_off() -> None:
    console = str(Path(sys.executable).parent / "bnb-gc-fix")
    result = run_python(["check", "--device", "cpu", "--json"], switch="0", executable=console)
    if not AFFECTED:  # upstream's fix holds without the package
        assert result.returncode == 0 and json.loads(result.stdout)["protected"] is True, result.stderr
        return
    assert result.returncode == 1, result.stderr
    payload = json.loads(result.stdout)
    assert payload["protected"] is False and payload["status"]["active"] is False
    counters = [s["counter"] for s in payload["steps"]]
    assert len(counters) == 4 and counters[0] > 0 and counters == sorted(counters)
    assert all(s["cache_bytes"] > 0 for s in payload["steps"])


def test_check_json_matches_its_table() -> None:
    table = run_python(["-m", "bnb_gc_fix", "check", "--steps", "2"], switch="0")
    data = run_python(["-m", "bnb_gc_fix", "check", "--steps", "2", "--json"], switch="0")
    assert table.returncode == data.returncode == 1
    rows = [
        [int(v) for v in line.split()] for line in table.stdout.splitlines() if line.strip()[:1].isdigit()
    ]
    payload = json.loads(data.stdout)
    assert rows == [[s["step"], s["counter"], s["cache_bytes"]] for s in payload["steps"]]
    assert payload["device"] == "cpu"  # the default without CUDA


def test_check_exits_2_without_bitsandbytes() -> None:
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'bitsandbytes':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from bnb_gc_fix.cli import main\n"
        "raise SystemExit(main(['check']))\n"
    )
    result = run_python(["-c", blocker])
    assert result.returncode == 2
    assert "install bitsandbytes>=0.48" in result.stderr


def test_check_rejects_bad_arguments() -> None:
    result = run_python(["-m", "bnb_gc_fix", "check", "--steps", "0"])
    assert result.returncode == 2 and "must be at least 1" in result.stderr
    result = run_python(["-m", "bnb_gc_fix", "check", "--device", "tpu"])
    assert result.returncode == 2 and "invalid choice" in result.stderr


# --- status ------------------------------------------------------------------------------------


@pytest.mark.stack
def test_status_json_on_an_affected_bitsandbytes() -> None:
    result = run_python(["-m", "bnb_gc_fix", "status", "--json"])
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()  # one object on one line, keys sorted (check --json's style)
    facts = json.loads(line)
    assert line == json.dumps(facts, sort_keys=True)
    assert facts["state"] == ("patched" if AFFECTED else "not needed")
    assert facts["counter"] == 0 and facts["cache_bytes"] == 0
    [bnb] = facts["libraries"]  # one record per library; bitsandbytes' is the first
    assert bnb["name"] == "bitsandbytes" and bnb["module"] == "bitsandbytes.nn.parametrize"
    assert bnb["version"] == BITSANDBYTES and str(TORCH).startswith(facts["torch"].split("+")[0])
    assert bnb["affected"] is AFFECTED and bnb["patched"] is AFFECTED and bnb["state"] == facts["state"]
    assert facts["active"] is AFFECTED and facts["via"] == ("start-up hook" if AFFECTED else None)
    assert facts["startup_hook"] == "installed"
    assert ("plain forward hook pair" if AFFECTED else "always_call=True") in bnb["probe"]
    assert facts["reason"] == bnb["reason"]
    assert facts["switch"] is None and facts["mode"] == "auto"
    for key in ("python", "transformers", "reason", "bnb_gc_fix"):
        assert facts[key]
    # Nothing about bitsandbytes is said twice: its facts live in its record alone.
    assert not {"bitsandbytes", "affected", "probe", "pending", "verdict"} & set(facts)


def test_status_json_switched_off_still_says_affected() -> None:
    facts = json.loads(run_python(["-m", "bnb_gc_fix", "status", "--json"], switch="off").stdout)
    assert facts["libraries"][0]["affected"] is True and facts["active"] is False
    assert facts["mode"] == "off" and facts["switch"] == "off"
    assert "disabled by the environment" in facts["reason"] and facts["state"] == "off"


@pytest.mark.stack
def test_status_text_names_versions_and_decision() -> None:
    result = run_python(["-m", "bnb_gc_fix", "status"])
    assert result.returncode == 0
    yes = "yes" if AFFECTED else "no"
    state = "patched, turned on by the start-up hook" if AFFECTED else "not needed"
    lines = result.stdout.splitlines()
    assert f"state:            {state}" in lines
    assert f"bitsandbytes {BITSANDBYTES}: {'patched' if AFFECTED else 'not needed'}" in lines
    assert any(line.startswith(f"  affected:       {yes} (the probe found: ") for line in lines)


# --- the guard ---------------------------------------------------------------------------------


def test_guard_releases_a_leak_every_step_with_one_warning_each() -> None:
    run = tiny_olmoe("--steps", "4", "--guard", switch="0")
    assert [s["counter"] for s in run.steps] == [0] * 4
    assert [s["cache_bytes"] for s in run.steps] == [0] * 4
    assert run.summary["package_warnings"] == 4
    assert run.summary["active"] is False


def test_guard_is_silent_with_the_fix_on() -> None:
    run = tiny_olmoe("--steps", "4", "--guard")
    assert [s["counter"] for s in run.steps] == [0] * 4
    assert run.summary["package_warnings"] == 0


def test_guard_strict_raises_and_releases() -> None:
    run = tiny_olmoe("--steps", "3", "--guard", "--strict", switch="0")
    assert run.summary["strict_raised"] == 3
    assert [s["counter"] for s in run.steps] == [0] * 3
    assert run.summary["package_warnings"] == 0


def test_guard_as_decorator_and_silent_without_torch() -> None:
    code = """
import sys, warnings, json
import bnb_gc_fix
@bnb_gc_fix.guard()
def step():
    return "ran"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = step()
print(json.dumps([result, len(caught), "torch" in sys.modules, bnb_gc_fix.reset()]))
"""
    assert json.loads(run_code(code).stdout) == ["ran", 0, False, 0]


def test_guard_after_keyboard_interrupt_reports_what_it_released() -> None:
    code = f"""
import sys, json, warnings; sys.path.insert(0, {str(SCENARIOS)!r})
import torch, bnb_gc_fix, quantized
module = quantized.make(params=2)
module.interrupt = KeyboardInterrupt
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        with bnb_gc_fix.guard():
            module(torch.randn(2, 64))
    except KeyboardInterrupt:
        pass
ours = [str(w.message) for w in caught if issubclass(w.category, bnb_gc_fix.CacheLeakWarning)]
print(json.dumps([quantized.counter(), ours]))
"""
    counter, warnings = json.loads(run_code(code).stdout)
    assert counter == 0
    assert len(warnings) == 1 and "went from 0 to 1" in warnings[0] and "KeyboardInterrupt" in warnings[0]


# --- the Hugging Face Trainer --------------------------------------------------------------------


@pytest.mark.stack
@pytest.mark.parametrize("callback", [True, False], ids=["with-callback", "control-without"])
def test_trainer_with_leak_guard_callback(callback: bool) -> None:
    result = run_python(
        [str(SCENARIOS / "trainer.py"), "--callback" if callback else "--no-callback"], switch="0"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout.splitlines()[-1])
    assert facts["steps"] == 4
    if callback:
        assert facts["counters"] == [0, 0, 0, 0]
        assert (facts["released"] > 0) is AFFECTED  # nothing to release on a fixed bitsandbytes
        assert "transformers" not in facts["imported_by_package"]
    elif AFFECTED:
        assert facts["counters"][-1] > facts["counters"][0] > 0
    else:
        assert facts["counters"] == [0, 0, 0, 0]
