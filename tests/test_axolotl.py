"""axolotl's copy of the cache pair (8-bit MoE experts), fixed with no code change.

The real axolotl wheels are installed with ``--no-deps`` into the test cache (``moe_quant`` needs
nothing beyond the ``test`` extra: torch, bitsandbytes, transformers, accelerate). Each runs on the
installed bitsandbytes (0.49.2 in CI) and on 0.50.2, where the bitsandbytes patch steps aside and
axolotl's copy still leaks. Every scenario runs in a fresh interpreter; every fix has its control.
"""

from __future__ import annotations

import json
import os
import platform
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    SCENARIOS,
    Prelude,
    Run,
    environment,
    pip_target,
    run_code,
    run_python,
)
from packaging.specifiers import SpecifierSet

pytestmark = [pytest.mark.usefixtures("startup_hook_installed"), pytest.mark.downloads]

SCENARIO = SCENARIOS / "axolotl_moe8bit.py"

# Requires-Python of each wheel, as published (checked against the installed METADATA below).
# 0.15.0-0.19.0 register a plain forward hook; 0.20.0 fixed it (always_call=True) and needs 3.12.
AXOLOTL = {"0.17.0": ">=3.10", "0.19.0": ">=3.10", "0.20.0": ">=3.12", "0.21.0": ">=3.12"}
AFFECTED = ("0.17.0", "0.19.0")
FIXED = ("0.20.0", "0.21.0")
BNB_050 = "0.50.2"


def _admitted(version: str) -> None:
    requires = AXOLOTL[version]
    if platform.python_version() not in SpecifierSet(requires):
        pytest.skip(
            f"axolotl {version} requires Python {requires}; this is Python {platform.python_version()} "
            "(runs in a cell whose Python admits it)"
        )


def _axolotl(version: str) -> Path:
    _admitted(version)
    target = pip_target(f"axolotl=={version}")
    (metadata,) = target.glob(f"axolotl-{version}.dist-info/METADATA")
    published = Parser().parsestr(metadata.read_text()).get("Requires-Python")
    assert published == AXOLOTL[version], f"axolotl {version}: Requires-Python is {published}"
    return target


def _pythonpath(axolotl: str, bitsandbytes: str) -> str:
    """axolotl's folder, after bitsandbytes 0.50.2's when asked for ("installed": the venv's own)."""
    paths = [str(_axolotl(axolotl))]
    if bitsandbytes == BNB_050:
        paths.insert(0, str(pip_target(f"bitsandbytes=={BNB_050}")))
    return os.pathsep.join(paths)


def _scenario(axolotl: str, bitsandbytes: str, *flags: str, switch: str | None = None) -> Run:
    env = environment(switch, PYTHONPATH=_pythonpath(axolotl, bitsandbytes))
    result = run_python([str(SCENARIO), "--steps", "4", "--layers", "3", "--log", *flags], env=env)
    assert result.returncode == 0, f"scenario failed:\n{result.stdout}\n{result.stderr}"
    assert result.summary["axolotl"] == axolotl
    if bitsandbytes == BNB_050:
        assert result.summary["bitsandbytes"] == BNB_050
    return result


def _library(run: Run, name: str) -> dict[str, Any]:
    return next(lib for lib in run.summary["libraries"] if lib["name"] == name)


def _counters(run: Run) -> list[int]:
    return [step["counter"] for step in run.steps]


BITSANDBYTES = pytest.mark.parametrize("bitsandbytes", ["installed", BNB_050])


# --- the headline measurement: 0, 0, 0, 0 with the package, 3, 6, 9, 12 without -------------


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", AFFECTED)
def test_start_up_hook_fixes_axolotl_with_no_code_change(axolotl: str, bitsandbytes: str) -> None:
    run = _scenario(axolotl, bitsandbytes)
    assert _counters(run) == [0, 0, 0, 0]
    assert [step["cache_bytes"] for step in run.steps] == [0, 0, 0, 0]
    # bitsandbytes was first imported by moe_quant itself; the start-up hook turned the fix on once
    # moe_quant's code had run to its end.
    assert run.summary["bitsandbytes_before_moe_quant"] is False
    assert run.summary["via"] == "start-up hook"
    assert run.summary["state"] == "patched"  # also on bitsandbytes 0.50.2, where only axolotl is
    assert _library(run, "axolotl") == {
        "name": "axolotl",
        "version": axolotl,
        "affected": True,
        "patched": True,
    }
    assert run.summary["hooks"]["pre_hook_owners"] == ["bnb_gc_fix"]  # the gate, once per module
    assert run.summary["hooks"]["always_called"] == 1


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", AFFECTED)
def test_axolotl_control_leaks_without_the_package(axolotl: str, bitsandbytes: str) -> None:
    run = _scenario(axolotl, bitsandbytes, switch="0")
    assert _counters(run) == [3, 6, 9, 12]
    assert run.steps[-1]["cache_bytes"] > 0
    assert run.summary["bnb_gc_fix_imported"] is False
    assert run.summary["hooks"]["pre_hook_owners"] == ["axolotl"]
    assert run.summary["hooks"]["always_called"] == 0


@BITSANDBYTES
def test_explicit_import_without_start_up_hook(bitsandbytes: str) -> None:
    code = """
        import runpy
        sys.argv = sys.argv[1:]  # the scenario's own command line
        runpy.run_path(sys.argv[0], run_name="__main__")
        """
    argv = [str(SCENARIO), "--steps", "4", "--import-fix"]
    for switch, expected in ((None, [0, 0, 0, 0]), ("0", [3, 6, 9, 12])):
        env = environment(switch, PYTHONPATH=_pythonpath("0.19.0", bitsandbytes))
        run = run_code(code, *argv, prelude="scenarios-without-startup-hook", env=env)
        assert _counters(run) == expected, switch
        assert run.summary["via"] == ("import" if switch is None else None)


def test_bitsandbytes_imported_first_patches_on_import() -> None:
    run = _scenario("0.19.0", "installed", "--bitsandbytes-first")
    assert run.summary["bitsandbytes_before_moe_quant"] is True
    assert _counters(run) == [0, 0, 0, 0]
    assert _library(run, "axolotl")["patched"] is True


# --- a fixed copy (axolotl >= 0.20) is left alone -------------------------------------------------


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", FIXED)
def test_fixed_axolotl_is_left_alone(axolotl: str, bitsandbytes: str) -> None:
    run = _scenario(axolotl, bitsandbytes)
    assert _counters(run) == [0, 0, 0, 0]
    assert _library(run, "axolotl") == {
        "name": "axolotl",
        "version": axolotl,
        "affected": False,
        "patched": False,
    }
    assert run.summary["hooks"]["pre_hook_owners"] == ["axolotl"]  # axolotl's own


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", FIXED)
def test_fixed_axolotl_control(axolotl: str, bitsandbytes: str) -> None:
    assert _counters(_scenario(axolotl, bitsandbytes, switch="0")) == [0, 0, 0, 0]


# --- status, deactivate, unexpected internals, repair ---------------------------------------------


def _snippet(
    code: str, axolotl: str = "0.19.0", switch: str | None = None, prelude: Prelude = "scenarios"
) -> Any:
    """The JSON a snippet prints last, run with axolotl ``axolotl`` on the installed bitsandbytes."""
    env = environment(switch, PYTHONPATH=_pythonpath(axolotl, "installed"))
    return run_code(code, prelude=prelude, env=env).last_json  # cwd: the checkout under test


def test_status_reports_each_library_and_deactivate_undoes_the_axolotl_patch() -> None:
    facts = _snippet(
        """
        from axolotl.monkeypatch import moe_quant
        import bnb_gc_fix
        import types
        # axolotl's own function is a plain function; the fix's wrapper is not
        wrapped = type(moe_quant.replace_parameter_8bit) is not types.FunctionType
        before = [lib.name for lib in bnb_gc_fix.status().libraries if lib.patched]
        bnb_gc_fix.deactivate()
        restored = type(moe_quant.replace_parameter_8bit) is types.FunctionType
        after = {lib.name: (lib.patched, lib.reason) for lib in bnb_gc_fix.status().libraries}
        print(json.dumps(dict(wrapped=wrapped, before=before, restored=restored, after=after)))
        """
    )
    assert facts["wrapped"] and facts["restored"]
    assert "axolotl" in facts["before"]
    assert facts["after"]["axolotl"] == [False, "deactivated by deactivate()"]


# Scenario 3 of issue 31: another tool wraps one of bitsandbytes' functions. Before the fix turns on (an
# explicit `import bnb_gc_fix`, no start-up hook), a wrapper without the function's name hides
# bitsandbytes' pair from the fix: bitsandbytes is skipped and its modules leak, while axolotl's copy is
# patched. After the fix turned on (the start-up hook), a wrapper takes the place of the fix's own, and
# bitsandbytes reads unpatched (whether or not the wrapper still calls the fix's). Either way status()
# must not say "patched". A (*args, **kwargs) wrapper of the register function, seen before the fix
# turns on, hides nothing: bitsandbytes is patched too.
WRAPPED_BY_ANOTHER_TOOL = """
from bitsandbytes.nn import parametrize
if sys.argv[1] == "unnamed-enable-hook":
    enable = parametrize._enable_parametrization_cache
    parametrize._enable_parametrization_cache = lambda module, inputs: enable(module, inputs)
else:
    register = parametrize._register_parametrization_hooks
    parametrize._register_parametrization_hooks = lambda *args, **kwargs: register(*args, **kwargs)
from axolotl.monkeypatch import moe_quant  # noqa: F401
import quantized
import bnb_gc_fix
four_bit = quantized.checkpointed_counters(quantized.make())
quantized.reset()
status = bnb_gc_fix.status()
print(json.dumps({
    "state": status.state, "active": status.active, "worst": status.worst_library.name,
    "libraries": {lib.name: lib.state for lib in status.libraries}, "four_bit": four_bit,
}))
"""

WRAPPED = {
    # (what is wrapped, whether the start-up hook runs): bitsandbytes' state, its 4-bit module leaks
    ("unnamed-enable-hook", False): ("skipped", True),
    ("args-kwargs-register", False): ("patched", False),
    ("unnamed-enable-hook", True): ("unpatched", True),
    ("args-kwargs-register", True): ("unpatched", False),  # the wrapper calls the fix's, which gates
}


@pytest.mark.parametrize(("wrapped", "startup_hook"), list(WRAPPED))
def test_status_is_the_worst_of_the_libraries_imported(wrapped: str, startup_hook: bool) -> None:
    env = environment(None, PYTHONPATH=_pythonpath("0.19.0", "installed"))
    prelude: Prelude = "scenarios" if startup_hook else "scenarios-without-startup-hook"
    facts = run_code(WRAPPED_BY_ANOTHER_TOOL, wrapped, prelude=prelude, env=env).last_json
    state, leaks = WRAPPED[(wrapped, startup_hook)]
    assert facts["libraries"] == {"bitsandbytes": state, "axolotl": "patched"}
    assert (facts["four_bit"][-1] > 0) is leaks
    if state == "patched":
        assert facts["four_bit"] == [0, 0, 0] and (facts["state"], facts["active"]) == ("patched", True)
    else:  # what is not patched decides, over axolotl's patch
        assert (facts["state"], facts["active"], facts["worst"]) == (state, False, "bitsandbytes")


def test_cli_status_lists_axolotl() -> None:
    env = environment(None, PYTHONPATH=_pythonpath("0.19.0", "installed"))
    facts = json.loads(run_python(["-m", "bnb_gc_fix", "status", "--json"], env=env).stdout)
    axolotl = next(lib for lib in facts["libraries"] if lib["name"] == "axolotl")
    assert axolotl["version"] == "0.19.0" and axolotl["affected"] is True and axolotl["patched"] is True
    assert "probe found a plain forward hook pair" in axolotl["reason"]
    text = run_python(["-m", "bnb_gc_fix", "status"], env=env).stdout
    assert "axolotl 0.19.0: patched" in text.splitlines()


def test_unexpected_axolotl_internals_mean_no_patch_and_one_warning() -> None:
    code = """
        import warnings
        from axolotl.monkeypatch import moe_quant
        moe_quant.replace_parameter_8bit = lambda module, param_name: None  # registers nothing
        original = moe_quant.replace_parameter_8bit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import bnb_gc_fix
            bnb_gc_fix.activate()
        ours = [str(w.message) for w in caught if isinstance(w.message, bnb_gc_fix.PatchSkippedWarning)]
        axolotl = next(lib for lib in bnb_gc_fix.status().libraries if lib.name == "axolotl")
        print(json.dumps(dict(patched=axolotl.patched, reason=axolotl.reason, warnings=ours,
            untouched=moe_quant.replace_parameter_8bit is original)))
        """
    facts = _snippet(code, prelude="scenarios-without-startup-hook")
    assert facts["patched"] is False and facts["untouched"]
    assert "got 0 enable and 0 disable cache hooks" in facts["reason"]
    assert facts["reason"].endswith("nothing patched")
    assert len(facts["warnings"]) == 1


REPAIR = """
import torch
from torch.utils.checkpoint import checkpoint
import bnb_gc_fix, axolotl_moe8bit
model = axolotl_moe8bit.build(layers=3)
before = axolotl_moe8bit.hook_counts(model)
fixed = bnb_gc_fix.repair(model)
again = bnb_gc_fix.repair(model)
after = axolotl_moe8bit.hook_counts(model)
x = torch.randn(4, 32)
counters = []
for step in range(3):
    h = x
    for layer in model:
        h = checkpoint(layer, h, use_reentrant=False)
    h.pow(2).mean().backward()
    counters.append(int(torch.nn.utils.parametrize._cache_enabled))
print(json.dumps(dict(fixed=fixed, again=again, before=before, after=after, counters=counters)))
"""


def test_repair_fixes_a_model_quantized_by_axolotl_while_switched_off() -> None:
    facts = _snippet(REPAIR, switch="0")
    assert facts["fixed"] == 3 and facts["again"] == 0  # one experts module per layer
    assert facts["after"]["pre_hook_owners"] == ["bnb_gc_fix"]
    assert facts["counters"] == [0, 0, 0]


@pytest.mark.parametrize("axolotl", FIXED)
def test_repair_leaves_a_fixed_axolotl_pair_alone(axolotl: str) -> None:
    facts = _snippet(REPAIR, axolotl=axolotl, switch="0")
    assert facts["fixed"] == 0 and facts["before"] == facts["after"]
    assert facts["counters"] == [0, 0, 0]


def test_moe_quant_import_failing_mid_way_is_decided_on_the_next_import() -> None:
    # The start-up hook fires on moe_quant's `import bitsandbytes`; a later line of moe_quant then
    # fails (a dependency that cannot be imported). The fix waits for the next, complete import.
    facts = _snippet(
        """
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "accelerate":
                    raise ImportError("accelerate blocked for this test")
        block = Block()
        sys.meta_path.insert(0, block)
        try:
            import axolotl.monkeypatch.moe_quant
        except ImportError as error:
            failed = str(error)
        sys.meta_path.remove(block)
        import bnb_gc_fix
        waiting = [lib.reason for lib in bnb_gc_fix.status().libraries if lib.name == "axolotl"]
        from axolotl.monkeypatch import moe_quant
        import axolotl_moe8bit
        model = axolotl_moe8bit.build(layers=1)
        patched = [lib.patched for lib in bnb_gc_fix.status().libraries if lib.name == "axolotl"]
        print(json.dumps(dict(failed=failed, waiting=waiting, patched=patched,
            hooks=axolotl_moe8bit.hook_counts(model)["pre_hook_owners"])))
        """
    )
    assert "accelerate blocked" in facts["failed"]
    assert facts["waiting"] == [
        "armed: axolotl.monkeypatch.moe_quant is not imported yet; "
        "the fix checks and patches it the moment it is"
    ]
    assert facts["patched"] == [True] and facts["hooks"] == ["bnb_gc_fix"]
