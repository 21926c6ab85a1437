"""bitsandbytes 0.50.x carries upstream's fix: the package steps aside (auto), or puts the fix in on
request (force), which covers what upstream cannot: a forward left by KeyboardInterrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli_calls, environment, pip_target, run_code, tiny_olmoe, unwrapped

pytestmark = pytest.mark.downloads

VERSION = "0.50.2"


@pytest.fixture(scope="session")
def bnb_050() -> Path:
    """bitsandbytes 0.50.2 installed with --no-deps into the test cache, shadowing 0.49.2 via PYTHONPATH."""
    return pip_target(f"bitsandbytes=={VERSION}")


def _env(target: Path, switch: str | None = None) -> dict[str, str]:
    return environment(switch, PYTHONPATH=str(target))


FRESH = "bitsandbytes 0.50.2 first on PYTHONPATH: the warm parent imported 0.49.2"
NOT_NEEDED = f"bitsandbytes {VERSION}'s hooks switch the cache off even when a forward raises"


def test_auto_steps_aside_and_upstream_fix_holds(bnb_050: Path) -> None:
    run = tiny_olmoe("--steps", "4", "--import-fix", env=_env(bnb_050), fresh=FRESH)
    assert [s["counter"] for s in run.steps] == [0] * 4
    assert run.summary["state"] == "not affected"
    # Said plainly: the fix is not needed here, what a Ctrl-C leaves, and what force does.
    reason = unwrapped(run.summary["reason"])
    assert reason.startswith(f"{NOT_NEEDED}: nothing to fix.")
    assert "A Ctrl-C inside a forward still leaves the cache on: a notebook cell's end reports it;" in reason
    assert reason.endswith(
        "BNB_GC_FIX=force puts the fix into these hooks too, and the layer's next forward then switches the "
        "cache off"
    )


def test_nothing_of_bitsandbytes_is_changed(bnb_050: Path) -> None:
    code = (
        "import logging, sys, json\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='LOG %(name)s: %(message)s')\n"
        "from bitsandbytes.nn import parametrize\n"
        "own = parametrize._enable_parametrization_cache.__code__\n"
        "import bitsandbytes, bnb_gc_fix, types\n"
        "s = bnb_gc_fix.activate()\n"
        "print(json.dumps([bitsandbytes.__version__, s.state, s.libraries[0].hooks, s.fixed,"
        " type(parametrize._register_parametrization_hooks) is types.FunctionType,"
        " parametrize._enable_parametrization_cache.__code__ is own]))\n"
    )
    result = run_code(code, env=_env(bnb_050, "on"), fresh=FRESH)
    assert result.last_json == [VERSION, "not affected", "do not leak this way", False, True, True]
    assert "LOG bnb_gc_fix" not in result.stdout


def test_status_json_on_upstream_fixed(bnb_050: Path) -> None:
    [(_, line, _)] = cli_calls(["status", "--json"], env=_env(bnb_050), fresh=FRESH)
    facts = json.loads(line)
    bnb = facts["libraries"][0]
    assert bnb["version"] == VERSION and bnb["state"] == facts["state"] == "not affected"
    assert bnb["hooks"] == "do not leak this way" and bnb["fixed"] is False and facts["fixed"] is False
    assert facts["asked_by"] == "import bnb_gc_fix"  # asked for, and not needed: nothing went in
    assert unwrapped(facts["reason"]).startswith(NOT_NEEDED)  # a job here
    assert unwrapped(facts["process"]["reason"]).startswith(NOT_NEEDED)  # the command's own process
    [(_, text, _)] = cli_calls(["status"], env=_env(bnb_050), fresh=FRESH)
    said = (
        f"fix: not needed here: the hooks of bitsandbytes {VERSION} do not leak this way (BNB_GC_FIX unset)"
    )
    assert said in unwrapped(text)


INTERRUPT = """
import torch, quantized
import bnb_gc_fix
module = quantized.make(params=2)
stuck = quantized.interrupted_forward(module, torch.randn(2, 64))
module(torch.randn(2, 64))
print(json.dumps([bnb_gc_fix.status().state, stuck, quantized.counter()]))
"""


def test_keyboard_interrupt_leaks_even_upstream_control(bnb_050: Path) -> None:
    result = run_code(INTERRUPT, prelude="scenarios", env=_env(bnb_050), fresh=FRESH)
    state, stuck, after = json.loads(result.stdout)
    assert state == "not affected" and stuck == 2 and after == 2  # upstream's always_call cannot see Ctrl-C


def test_force_patches_upstream_too_and_heals_keyboard_interrupt(bnb_050: Path) -> None:
    result = run_code(INTERRUPT, prelude="scenarios", env=_env(bnb_050, "force"), fresh=FRESH)
    assert json.loads(result.stdout) == ["protected", 1, 0]


def test_force_status_reason_says_why(bnb_050: Path) -> None:
    [(_, line, _)] = cli_calls(["status", "--json"], env=_env(bnb_050, "FORCE"), fresh=FRESH)
    facts = json.loads(line)
    assert facts["asked_by"] == "import bnb_gc_fix" and facts["switch"] == "FORCE"
    # A job here: protected (force puts the fix into hooks that do not leak this way, and it covers them).
    assert facts["libraries"][0]["hooks"] == "do not leak this way" and facts["state"] == "protected"
    assert facts["libraries"][0]["fixed"] is True  # force: the fix is in hooks that do not leak
    assert (
        "no module in this process has weights quantized with replace_parameter_4bit now"
        in (facts["process"]["reason"])
    )  # nothing quantized in the command's own process


QUANTIZED = """
import quantized, bnb_gc_fix
module = quantized.make(params=2)
count = lambda: (len(module._forward_pre_hooks), len(module._forward_hooks_always_called))
pairs = count()
module(__import__("torch").randn(2, 64))
print(json.dumps([pairs, count()]))
"""


def test_upstreams_always_called_pairs_are_left_alone(bnb_050: Path) -> None:
    # What BNB_GC_FIX=force does instead (the fix covers them, and switches off what a Ctrl-C left):
    # test_hostile_hosts.py::test_force_on_a_fixed_bitsandbytes_covers_a_module_quantized_before_the_fix.
    result = run_code(QUANTIZED, prelude="scenarios", env=_env(bnb_050), fresh=FRESH)
    pairs, after_a_forward = json.loads(result.stdout)
    assert pairs == [2, 2]  # upstream's pair per parameter, its disable hook always-called
    assert after_a_forward == [2, 2]  # not covered: bitsandbytes' own pairs, as registered


# Issue 41's finding 6: `bnb-gc-fix check` on a release that does not leak says so, and that nothing was
# needed (it said "protected"); the control is the same check with the fix switched off.
def test_check_on_a_release_that_does_not_leak_says_nothing_was_needed(bnb_050: Path) -> None:
    for switch in (None, "0"):
        [(code, out, err)] = cli_calls(["check", "--device", "cpu"], env=_env(bnb_050, switch), fresh=FRESH)
        assert code == 0, err
        said = unwrapped(out)
        # Issue 54's finding 2: the same state in the same words, with the fix on or off; the fix line
        # says which.
        assert f"state: not affected: {NOT_NEEDED}: nothing to fix." in said
        if switch is None:
            assert f"fix: not needed here: the hooks of bitsandbytes {VERSION} do not leak this way" in said
        else:
            assert "fix: off (BNB_GC_FIX='0')" in said
        assert out.splitlines()[-1].startswith("not affected: ") and "nothing was needed" in said
        assert "protected" not in out
