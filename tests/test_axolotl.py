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
    cli_calls,
    environment,
    pip_target,
    run_code,
    run_python,
    unwrapped,
)
from packaging.specifiers import SpecifierSet

pytestmark = [pytest.mark.usefixtures("startup_hook_installed"), pytest.mark.downloads]

SCENARIO = SCENARIOS / "axolotl_moe8bit.py"
FRESH = "axolotl (and maybe another bitsandbytes) first on PYTHONPATH"

# Requires-Python of each wheel, as published (checked against the installed METADATA below).
# 0.15.0-0.19.0 register a plain forward hook (0.17.0 and 0.19.0 tested); 0.20.0 fixed it
# (always_call=True) and needs Python 3.12.
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
    argv = [str(SCENARIO), "--steps", "4", "--layers", "3", "--log", *flags]
    result = run_python(argv, env=env, fresh=FRESH)
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
    assert run.summary["asked_by"] == "the start-up hook"
    assert run.summary["state"] == "protected"  # also on bitsandbytes 0.50.2, where only axolotl is
    library = _library(run, "axolotl")
    assert {key: library[key] for key in ("version", "hooks", "fixed", "state")} == {
        "version": axolotl,
        "hooks": "leak this way",
        "fixed": True,
        "state": "protected",
    }
    assert run.summary["hooks"] == {"pre_hooks": 1, "hooks": 1, "always_called": 1}  # its pair, always called


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", AFFECTED)
def test_axolotl_control_leaks_without_the_package(axolotl: str, bitsandbytes: str) -> None:
    run = _scenario(axolotl, bitsandbytes, switch="0")
    assert _counters(run) == [3, 6, 9, 12]
    assert run.steps[-1]["cache_bytes"] > 0
    assert run.summary["bnb_gc_fix_imported"] is False
    assert run.summary["hooks"] == {"pre_hooks": 1, "hooks": 1, "always_called": 0}  # axolotl's plain pair


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
        run = run_code(code, *argv, prelude="scenarios-without-startup-hook", env=env, fresh=FRESH)
        assert _counters(run) == expected, switch
        assert run.summary["asked_by"] == ("import bnb_gc_fix" if switch is None else None)


def test_bitsandbytes_imported_first_patches_on_import() -> None:
    run = _scenario("0.19.0", "installed", "--bitsandbytes-first")
    assert run.summary["bitsandbytes_before_moe_quant"] is True
    assert _counters(run) == [0, 0, 0, 0]
    assert _library(run, "axolotl")["state"] == "protected"


# --- a fixed copy (axolotl >= 0.20) is left alone -------------------------------------------------


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", FIXED)
def test_fixed_axolotl_is_left_alone(axolotl: str, bitsandbytes: str) -> None:
    run = _scenario(axolotl, bitsandbytes)
    assert _counters(run) == [0, 0, 0, 0]
    library = _library(run, "axolotl")
    assert {key: library[key] for key in ("version", "hooks", "fixed", "state")} == {
        "version": axolotl,
        "hooks": "do not leak this way",
        "fixed": False,
        "state": "not affected",
    }
    # Its register function registers the pair through a helper of axolotl's own; its off hook is always
    # called (d75b8f8 decided it so, from its first module).
    said = f"axolotl {axolotl}'s hooks switch the cache off even when a forward raises: nothing to fix."
    assert unwrapped(library["reason"]).startswith(said), library["reason"]
    assert run.summary["hooks"]["always_called"] == 1  # axolotl's own, as it registered it


@BITSANDBYTES
@pytest.mark.parametrize("axolotl", FIXED)
def test_fixed_axolotl_control(axolotl: str, bitsandbytes: str) -> None:
    assert _counters(_scenario(axolotl, bitsandbytes, switch="0")) == [0, 0, 0, 0]


# --- status, another tool's functions, unexpected internals, quantized before the fix ---------------------


def _snippet(
    code: str, axolotl: str = "0.19.0", switch: str | None = None, prelude: Prelude = "scenarios"
) -> Any:
    """The JSON a snippet prints last, run with axolotl ``axolotl`` on the installed bitsandbytes."""
    env = environment(switch, PYTHONPATH=_pythonpath(axolotl, "installed"))
    return run_code(code, prelude=prelude, env=env, fresh=FRESH).last_json  # cwd: the checkout under test


def test_status_reports_each_library_and_the_register_function_is_wrapped() -> None:
    facts = _snippet(
        """
        from axolotl.monkeypatch import moe_quant
        import bnb_gc_fix
        import axolotl_moe8bit
        model = axolotl_moe8bit.build(layers=1)
        wrapped = hasattr(moe_quant.replace_parameter_8bit, "__wrapped__")  # the fix's wrapper
        libraries = {lib.name: [lib.state, lib.fixed] for lib in bnb_gc_fix.status().libraries}
        print(json.dumps(dict(wrapped=wrapped, libraries=libraries)))
        """
    )
    assert facts["wrapped"]
    # axolotl imports bitsandbytes, never its 4-bit module: the fix is in axolotl's hooks alone
    assert facts["libraries"] == {"axolotl": ["protected", True], "bitsandbytes": ["not affected", False]}


# Another tool puts a function of its own in the place of one of bitsandbytes'. A pre-hook of its own is not
# the pair the fix knows: before the fix turns on (an explicit `import bnb_gc_fix`, no start-up hook) the
# fix stays out of it; after (the start-up hook), the fix is in bitsandbytes' functions, but the modules
# quantized then hold the tool's pre-hook, which the fix cannot cover. Either way they leak, as without the
# fix, and status() must say so ("unprotected"), over axolotl's state. A register function of its own that
# calls bitsandbytes': put in before the fix reads bitsandbytes' code, its code calls a function whose code
# registers bitsandbytes' pair by name, which the reading follows (never running it), so the fix goes in
# and covers what it quantizes; put in after, it calls the fix's wrapper. Either way: protected.
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
    "state": status.state, "worst": status.worst.name,
    "libraries": {lib.name: lib.state for lib in status.libraries}, "four_bit": four_bit,
}))
"""

WRAPPED = {
    # (what is wrapped, whether the start-up hook runs): bitsandbytes' state, its 4-bit module leaks
    ("unnamed-enable-hook", False): ("unprotected", True),
    ("args-kwargs-register", False): ("protected", False),
    ("unnamed-enable-hook", True): ("unprotected", True),
    ("args-kwargs-register", True): ("protected", False),
}


@pytest.mark.parametrize(("wrapped", "startup_hook"), list(WRAPPED))
def test_status_is_the_worst_of_the_libraries_imported(wrapped: str, startup_hook: bool) -> None:
    env = environment(None, PYTHONPATH=_pythonpath("0.19.0", "installed"))
    prelude: Prelude = "scenarios" if startup_hook else "scenarios-without-startup-hook"
    facts = run_code(WRAPPED_BY_ANOTHER_TOOL, wrapped, prelude=prelude, env=env, fresh=FRESH).last_json
    state, leaks = WRAPPED[(wrapped, startup_hook)]
    assert facts["libraries"] == {"bitsandbytes": state, "axolotl": "not affected"}  # nothing of axolotl's
    assert (facts["four_bit"][-1] > 0) is leaks
    assert (facts["state"], facts["worst"]) == (state, "bitsandbytes")  # the worst decides


def test_cli_status_lists_axolotl() -> None:
    env = environment(None, PYTHONPATH=_pythonpath("0.19.0", "installed"))
    (_, line, _), (_, text, _) = cli_calls(["status", "--json"], ["status"], env=env, fresh=FRESH)
    facts = json.loads(line)
    axolotl = next(lib for lib in facts["libraries"] if lib["name"] == "axolotl")
    assert axolotl["version"] == "0.19.0" and axolotl["hooks"] == "leak this way"  # read from its code
    assert axolotl["fixed"] is True
    said = "the fix covers the modules a job here quantizes with quantize_moe_experts"
    assert axolotl["state"] == "protected" and said == unwrapped(axolotl["reason"])
    assert f"axolotl 0.19.0: protected: {said}" in unwrapped(text)  # a line of its own, beside bitsandbytes


def test_a_register_function_whose_code_names_no_hook_function_is_unreadable_and_never_called() -> None:
    # Its off hook's name is gone from its module: the code does not say what it registers. The fix stays
    # out, one warning says so; the register function first runs in the user's own call, which fails as
    # in the control.
    code = """
        import warnings
        from axolotl.monkeypatch import moe_quant
        del moe_quant._disable_parametrization_cache  # its register function fails wherever it runs
        original = moe_quant.replace_parameter_8bit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import bnb_gc_fix
            bnb_gc_fix.activate()
            axolotl = bnb_gc_fix.status().library("axolotl")
            import axolotl_moe8bit
            try:
                axolotl_moe8bit.build(layers=1)
            except NameError as error:
                failed = str(error)
        ours = [str(w.message) for w in caught if isinstance(w.message, bnb_gc_fix.BnbGcFixWarning)]
        print(json.dumps(dict(state=axolotl.state, reason=axolotl.reason, hooks=axolotl.hooks, warnings=ours,
            failed=failed, own=moe_quant.replace_parameter_8bit is original)))
        """
    fixed = _snippet(code, prelude="scenarios-without-startup-hook")
    control = _snippet(code, switch="0", prelude="scenarios-without-startup-hook")
    assert "_disable_parametrization_cache" in fixed["failed"] and fixed["failed"] == control["failed"]
    assert fixed["own"] and control["own"]  # the fix stays out: the register function is axolotl's own
    assert fixed["hooks"] == "cannot be read" and fixed["state"] == "not affected"  # nothing quantized yet
    [warning] = fixed["warnings"]  # activate() again adds none
    assert unwrapped(warning).startswith(
        "bnb-gc-fix is not in axolotl 0.19.0: bnb-gc-fix cannot read its hooks"
    )
    assert "which bnb-gc-fix cannot read" in unwrapped(fixed["reason"])
    assert control["warnings"] == []


QUANTIZED_BEFORE_THE_FIX = """
import torch
from torch.utils.checkpoint import checkpoint
import axolotl_moe8bit
model = axolotl_moe8bit.build(layers=3)  # quantized before the fix is on: axolotl's own plain pairs
import bnb_gc_fix  # reads axolotl's code: its functions get the fix's code
state_before = next(lib.state for lib in bnb_gc_fix.status().libraries if lib.name == "axolotl")
before = axolotl_moe8bit.hook_counts(model)
x = torch.randn(4, 32)
counters = []
for step in range(3):
    h = x
    for layer in model:
        h = checkpoint(layer, h, use_reentrant=False)
    h.pow(2).mean().backward()
    counters.append(int(torch.nn.utils.parametrize._cache_enabled))
after = axolotl_moe8bit.hook_counts(model)
print(json.dumps(dict(before=before, after=after, counters=counters, state_before=state_before)))
"""


def test_a_model_quantized_by_axolotl_before_the_fix_is_covered_at_its_next_forward() -> None:
    facts = _snippet(QUANTIZED_BEFORE_THE_FIX, prelude="scenarios-without-startup-hook")
    assert (
        facts["state_before"] == "protected"
    )  # the fix read axolotl's code: each covered at its next forward
    assert facts["before"]["always_called"] == 0 and facts["after"]["always_called"] == 1
    assert facts["counters"] == [0, 0, 0]


@pytest.mark.parametrize("axolotl", FIXED)
def test_a_fixed_axolotls_pair_is_left_alone(axolotl: str) -> None:
    facts = _snippet(QUANTIZED_BEFORE_THE_FIX, axolotl=axolotl, prelude="scenarios-without-startup-hook")
    assert facts["before"] == facts["after"]
    assert facts["counters"] == [0, 0, 0]


def test_moe_quant_import_failing_mid_way_is_decided_on_the_next_import() -> None:
    # The start-up hook fires on moe_quant's `import bitsandbytes`; a later line of moe_quant then
    # fails (a dependency that cannot be imported). The fix decides at the next, complete import.
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
        state = [lib.state for lib in bnb_gc_fix.status().libraries if lib.name == "axolotl"]
        print(json.dumps(dict(failed=failed, waiting=waiting, state=state,
            hooks=axolotl_moe8bit.hook_counts(model)["always_called"])))
        """
    )
    assert "accelerate blocked" in facts["failed"]
    assert facts["waiting"] == [
        "no module in this process has weights quantized with quantize_moe_experts now"
    ]
    assert facts["state"] == ["protected"] and facts["hooks"] == 1
