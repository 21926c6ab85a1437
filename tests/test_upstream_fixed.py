"""bitsandbytes 0.50.x carries upstream's fix: the package steps aside (auto), or puts the fix in on
request (force), which covers what upstream cannot: a forward left by KeyboardInterrupt."""

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
    assert run.summary["state"] == "not affected"
    # Said plainly: the package is not needed here, but for Ctrl-C, and how to remove it.
    assert run.summary["reason"].startswith(f"bitsandbytes {VERSION} does not leak this way")
    assert "what a Ctrl-C inside a forward leaves is only pointed out here" in run.summary["reason"]
    assert run.summary["reason"].endswith("pip uninstall bnb-gc-fix removes the package")


def test_nothing_of_bitsandbytes_is_changed(bnb_050: Path) -> None:
    code = (
        "import logging, sys, json\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='LOG %(name)s: %(message)s')\n"
        "from bitsandbytes.nn import parametrize\n"
        "own = parametrize._enable_parametrization_cache.__code__\n"
        "import bitsandbytes, bnb_gc_fix, types\n"
        "s = bnb_gc_fix.activate()\n"
        "print(json.dumps([bitsandbytes.__version__, s.state, s.libraries[0].affected,"
        " type(parametrize._register_parametrization_hooks) is types.FunctionType,"
        " parametrize._enable_parametrization_cache.__code__ is own]))\n"
    )
    result = run_code(code, env=_env(bnb_050, "on"))
    assert result.last_json == [VERSION, "not affected", False, True, True]
    assert "LOG bnb_gc_fix" not in result.stdout


def test_status_json_on_upstream_fixed(bnb_050: Path) -> None:
    result = run_python(["-m", "bnb_gc_fix", "status", "--json"], env=_env(bnb_050))
    facts = json.loads(result.stdout)
    bnb = facts["libraries"][0]
    assert bnb["version"] == VERSION and bnb["state"] == facts["state"] == "not affected"
    assert bnb["affected"] is False and facts["on"] is True
    assert f"bitsandbytes {VERSION} does not leak this way" in facts["reason"]


INTERRUPT = """
import torch, quantized
import bnb_gc_fix
module = quantized.make(params=2)
stuck = quantized.interrupted_forward(module, torch.randn(2, 64))
module(torch.randn(2, 64))
print(json.dumps([bnb_gc_fix.status().state, stuck, quantized.counter()]))
"""


def test_keyboard_interrupt_leaks_even_upstream_control(bnb_050: Path) -> None:
    result = run_code(INTERRUPT, prelude="scenarios", env=_env(bnb_050))
    state, stuck, after = json.loads(result.stdout)
    assert state == "not affected" and stuck == 2 and after == 2  # upstream's always_call cannot see Ctrl-C


def test_force_patches_upstream_too_and_heals_keyboard_interrupt(bnb_050: Path) -> None:
    result = run_code(INTERRUPT, prelude="scenarios", env=_env(bnb_050, "force"))
    assert json.loads(result.stdout) == ["protected", 1, 0]


def test_force_status_reason_says_why(bnb_050: Path) -> None:
    facts = json.loads(
        run_python(["-m", "bnb_gc_fix", "status", "--json"], env=_env(bnb_050, "FORCE")).stdout
    )
    assert facts["on"] is True and facts["switch"] == "FORCE"
    assert f"the fix is in bitsandbytes {VERSION} (BNB_GC_FIX=force)" in facts["reason"]


REPAIR = """
import quantized, bnb_gc_fix
module = quantized.make(params=2)
count = lambda: (len(module._forward_pre_hooks), len(module._forward_hooks_always_called))
pairs = count()
fixed = bnb_gc_fix.repair(module)
print(json.dumps([pairs, fixed, count()]))
"""


def test_repair_leaves_upstream_always_called_pairs_alone(bnb_050: Path) -> None:
    # What BNB_GC_FIX=force does instead (the fix takes them over, and heals a Ctrl-C):
    # test_hostile_hosts.py::test_repair_honours_force_on_a_fixed_bitsandbytes.
    result = run_code(REPAIR, prelude="scenarios", env=_env(bnb_050))
    pairs, fixed, untouched = json.loads(result.stdout)
    assert pairs == [2, 2]  # upstream's pair per parameter, its disable hook always-called
    assert fixed == 0 and untouched == [2, 2]  # already right: not replaced, not counted
