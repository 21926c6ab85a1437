"""bitsandbytes 0.50.x carries upstream's fix: the package steps aside (auto), or patches on request
(force), and the guard still covers what upstream cannot: a forward left by KeyboardInterrupt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import environment, pip_target, run_code, run_python, tiny_olmoe

pytestmark = pytest.mark.downloads

VERSION = "0.50.2"


@pytest.fixture(scope="session")
def bnb_050() -> Path:
    """bitsandbytes 0.50.2 installed with --no-deps into the test cache, shadowing 0.49.2 via PYTHONPATH."""
    return pip_target(f"bitsandbytes=={VERSION}")


def _env(target: Path, switch: str | None = None) -> dict[str, str]:
    return environment(switch, PYTHONPATH=str(target))


def test_auto_steps_aside_and_upstream_fix_holds(bnb_050: Path) -> None:
    run = tiny_olmoe("--steps", "4", "--import-fix", env=_env(bnb_050))
    assert [s["counter"] for s in run.steps] == [0] * 4
    assert run.summary["active"] is False and run.summary["state"] == "not needed"
    assert "always_call=True (upstream fix)" in run.summary["reason"]
    # Said plainly: the package is not needed here, but for Ctrl-C in notebooks, and how to remove it.
    plainly = "; nothing to patch. bnb-gc-fix is not needed with this bitsandbytes, except"
    assert plainly in run.summary["reason"]
    assert run.summary["reason"].endswith("pip uninstall bnb-gc-fix removes it")


def test_nothing_is_wrapped_and_on_mode_says_so_in_the_log(bnb_050: Path) -> None:
    code = (
        "import logging, sys, json\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='LOG %(name)s: %(message)s')\n"
        "from bitsandbytes.nn import parametrize\n"
        "import bitsandbytes, bnb_gc_fix, types\n"
        "s = bnb_gc_fix.activate()\n"
        "print(json.dumps([bitsandbytes.__version__, s.active, s.bitsandbytes.affected,"
        " type(parametrize._register_parametrization_hooks) is not types.FunctionType]))\n"
    )
    result = run_code(code, env=_env(bnb_050, "on"))
    assert result.last_json == [VERSION, False, False, False]
    assert "LOG bnb_gc_fix: nothing needed patching" in result.stdout


def test_status_json_on_upstream_fixed(bnb_050: Path) -> None:
    result = run_python(["-m", "bnb_gc_fix", "status", "--json"], env=_env(bnb_050))
    facts = json.loads(result.stdout)
    [bnb] = facts["libraries"]
    assert bnb["version"] == VERSION and bnb["state"] == "not needed"
    assert bnb["affected"] is False and bnb["patched"] is False
    assert facts["active"] is False
    assert "upstream fix" in facts["reason"]


INTERRUPT = """
import torch, quantized
import bnb_gc_fix
module = quantized.make(params=2)
stuck = quantized.interrupted_forward(module, torch.randn(2, 64))
module(torch.randn(2, 64))
print(json.dumps([bnb_gc_fix.status().active, stuck, quantized.counter()]))
"""


def test_keyboard_interrupt_leaks_even_upstream_control(bnb_050: Path) -> None:
    result = run_code(INTERRUPT, prelude="scenarios", env=_env(bnb_050))
    active, stuck, after = json.loads(result.stdout)
    assert active is False and stuck == 2 and after == 2  # upstream's always_call cannot see Ctrl-C


def test_force_patches_upstream_too_and_heals_keyboard_interrupt(bnb_050: Path) -> None:
    result = run_code(INTERRUPT, prelude="scenarios", env=_env(bnb_050, "force"))
    assert json.loads(result.stdout) == [True, 1, 0]


def test_force_status_reason_says_why(bnb_050: Path) -> None:
    facts = json.loads(
        run_python(["-m", "bnb_gc_fix", "status", "--json"], env=_env(bnb_050, "FORCE")).stdout
    )
    assert facts["active"] is True and facts["mode"] == "force"
    assert "BNB_GC_FIX=force" in facts["reason"]


REPAIR = """
import quantized, bnb_gc_fix
module = quantized.make(params=2)
count = lambda: (len(module._forward_pre_hooks), len(module._forward_hooks_always_called))
pairs = count()
fixed = bnb_gc_fix.repair(module)
print(json.dumps([pairs, fixed, count()]))
"""


def test_repair_leaves_upstream_always_called_pairs_alone(bnb_050: Path) -> None:
    # What BNB_GC_FIX=force does instead (the gate replaces them, and heals a Ctrl-C):
    # test_hostile_hosts.py::test_repair_honours_force_on_a_fixed_bitsandbytes.
    result = run_code(REPAIR, prelude="scenarios", env=_env(bnb_050))
    pairs, fixed, untouched = json.loads(result.stdout)
    assert pairs == [2, 2]  # upstream's pair per parameter, its disable hook always-called
    assert fixed == 0 and untouched == [2, 2]  # already right: not replaced, not counted
