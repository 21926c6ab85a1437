"""The safety nets that work whatever caused a leak: ``guard()`` around a step (warn, strict,
decorator) and the Hugging Face ``Trainer`` callback, each beside a control."""

from __future__ import annotations

import json

import pytest
from conftest import (
    AFFECTED,
    SCENARIOS,
    run_code,
    run_python,
    shared,
    tiny_olmoe,
    tiny_olmoe_control,
    unwrapped,
)

# --- the guard ---------------------------------------------------------------------------------


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes: a leak to report")
def test_guard_with_the_fix_off_reports_every_leaking_step_and_leaves_the_counter_as_the_control() -> None:
    control = tiny_olmoe_control()
    run = tiny_olmoe("--steps", "4", "--guard", switch="0")
    assert [s["counter"] for s in run.steps] == [s["counter"] for s in control.steps[:4]]
    assert run.steps[-1]["counter"] > run.steps[0]["counter"] > 0
    assert run.summary["package_warnings"] == 4 and control.summary["package_warnings"] == 0
    assert run.summary["state"] == "unprotected"


def test_guard_is_silent_with_the_fix_on() -> None:
    run = tiny_olmoe("--steps", "4", "--guard")
    assert [s["counter"] for s in run.steps] == [0] * 4
    assert run.summary["package_warnings"] == 0


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes: a leak to raise for")
def test_guard_strict_raises_for_every_step_that_leaked() -> None:
    run = tiny_olmoe("--steps", "3", "--guard", "--strict", switch="0")
    assert run.summary["strict_raised"] == 3
    assert run.steps[-1]["counter"] > run.steps[0]["counter"] > 0  # raised; nothing of it was the guard's
    assert run.summary["package_warnings"] == 0
    fixed = tiny_olmoe("--steps", "3", "--guard", "--strict")
    assert fixed.summary["strict_raised"] == 0 and [s["counter"] for s in fixed.steps] == [0] * 3


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
    result = run_code(code, fresh="a process that never imports torch")
    assert json.loads(result.stdout) == ["ran", 0, False, 0]


# A step left by a BaseException that is not an Exception (KeyboardInterrupt, and SystemExit as much:
# issue 41's finding 4), which leaves a forward without its forward hooks; "unguarded" is the control.
BASE_EXCEPTION_IN_A_FORWARD = """
import warnings
import torch, bnb_gc_fix, quantized
raised = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[sys.argv[1]]
module = quantized.make(params=2)
module.interrupt = raised
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        with bnb_gc_fix.guard() if sys.argv[2] == "guarded" else contextlib.nullcontext():
            module(torch.randn(2, 64))
    except raised:
        pass
ours = [str(w.message) for w in caught if issubclass(w.category, bnb_gc_fix.CacheLeakWarning)]
print(json.dumps([quantized.counter(), ours]))
"""


@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "SystemExit"])
def test_guard_after_a_base_exception_in_a_forward_reports_what_it_switched_off(raised: str) -> None:
    code = "import contextlib\n" + BASE_EXCEPTION_IN_A_FORWARD
    counter, warnings = run_code(code, raised, "guarded", prelude="scenarios").last_json
    assert counter == 0
    # One warning, saying what was switched off, and why.
    (warning,) = warnings
    said = unwrapped(warning)
    assert said.startswith("bnb_gc_fix.guard: the step left the cache switched on. ")
    assert "1 forward in the step switched the cache on and stopped before switching it off" in said
    assert "(by KeyboardInterrupt, SystemExit or another BaseException" in said
    assert "The fix switched it off (16384 bytes were cached)." in said
    assert all(len(line) <= 100 for line in warning.splitlines())
    if raised == "SystemExit":  # the control, once: the same step unguarded keeps it on, and says nothing
        assert run_code(code, raised, "unguarded", prelude="scenarios").last_json == [1, []]


def test_under_warnings_as_errors_the_guard_never_replaces_the_steps_own_exception() -> None:
    code = """
import warnings
import torch, bnb_gc_fix, quantized
module = quantized.make(params=1)
module.interrupt = KeyboardInterrupt
warnings.filterwarnings("error", category=bnb_gc_fix.CacheLeakWarning)  # the package's, as errors
try:
    with bnb_gc_fix.guard():
        module(torch.randn(2, 64))
except BaseException as error:
    print(type(error).__name__, quantized.counter())
"""
    fixed = run_code(code, prelude="scenarios")
    assert fixed.stdout.split() == ["KeyboardInterrupt", "0"], fixed.stderr  # given back; the step's own
    # The control: a step that raises nothing, under the same filters, gets the report as an error.
    quiet = code.replace("module.interrupt = KeyboardInterrupt", "module.interrupt = None").replace(
        "module(torch.randn(2, 64))", "quantized.interrupted_forward(module, torch.randn(2, 64))"
    )
    control = run_code(quiet, prelude="scenarios")
    assert control.stdout.split() == ["CacheLeakWarning", "0"], control.stderr


# --- every leaking step is reported, under Python's default warning filters -------------------------

# Three steps that each leave a hold (a Ctrl-C in a forward), each guarded by sys.argv[1]; the control
# emits the same warning three times with warnings.warn, which the default filters show once. Nothing here
# changes the filters: stderr shows what a user's log shows.
THREE_LEAKING_STEPS = """
import warnings
from types import SimpleNamespace
import torch, bnb_gc_fix, quantized
from bnb_gc_fix.integrations.transformers import LeakGuardCallback
module = quantized.make(params=1)
x = torch.randn(4, 64)
callback = LeakGuardCallback()
for step in range(1, 4):
    if sys.argv[1] == "guard":
        with bnb_gc_fix.guard():
            quantized.interrupted_forward(module, x)
    elif sys.argv[1] == "callback":
        state = SimpleNamespace(global_step=step)
        callback.on_step_begin(None, state, None)
        quantized.interrupted_forward(module, x)
        callback.on_step_end(None, state, None)
    else:  # the control: the same report, as warnings.warn gives it
        quantized.interrupted_forward(module, x)
        bnb_gc_fix.reset()
        warnings.warn("bnb_gc_fix.guard: the step left the cache switched on.", bnb_gc_fix.CacheLeakWarning)
print(json.dumps(quantized.counter()))
"""


@pytest.mark.parametrize("net", ["guard", "callback"])
def test_every_leaking_step_is_reported_under_the_default_filters(net: str) -> None:
    control = shared(
        "three-leaking-steps", lambda: run_code(THREE_LEAKING_STEPS, "control", prelude="scenarios")
    )
    assert control.stderr.count("CacheLeakWarning: ") == 1  # three leaks, one line
    fixed = run_code(THREE_LEAKING_STEPS, net, prelude="scenarios")
    reports = [line for line in fixed.stderr.splitlines() if "CacheLeakWarning: " in line]
    assert len(reports) == 3 and fixed.last_json == 0, fixed.stderr
    assert all("left the cache switched on." in line for line in reports)
    if net == "callback":
        assert [f"bnb_gc_fix: step {step} left" in line for step, line in enumerate(reports, 1)] == [True] * 3


# --- the Hugging Face Trainer --------------------------------------------------------------------


@pytest.mark.stack
@pytest.mark.parametrize("switch", ["0", None], ids=["fix-off", "fix-on"])
@pytest.mark.parametrize("callback", [True, False], ids=["with-callback", "control-without"])
def test_trainer_with_leak_guard_callback(callback: bool, switch: str | None) -> None:
    script = [str(SCENARIOS / "trainer.py"), "--callback" if callback else "--no-callback"]
    result = run_python(script, switch=switch)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = result.last_json
    assert facts["steps"] == 4
    if switch is None or not AFFECTED:  # nothing leaks, nothing to report
        assert facts["counters"] == [0, 0, 0, 0] and facts["reports"] == []
        assert facts["given_back"] == (0 if callback else None)
        return
    # The fix off: the counter climbs as the control's does, and every step is reported, by its number.
    assert facts["counters"][-1] > facts["counters"][0] > 0
    if callback:
        assert facts["given_back"] == 0 and len(facts["reports"]) == 4
        began = [
            f"when step {step} began" in unwrapped(report) for step, report in enumerate(facts["reports"], 1)
        ]
        assert began == [True] * 4


def test_importing_the_package_imports_none_of_the_libraries() -> None:
    libraries = "{'torch', 'bitsandbytes', 'transformers'}"
    code = f"import bnb_gc_fix; print(json.dumps(sorted({libraries} & set(sys.modules))))"
    fresh = "what importing the package imports (the warm parent imported them all)"
    assert run_code(code, prelude="scenarios", fresh=fresh).last_json == []
