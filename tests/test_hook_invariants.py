"""The fix's switch-on rule and a span's rule (a notebook cell's), for every program, and the behaviours
each pinned by a test of its own.

The property test runs Hypothesis in a process of its own (``tests/scenarios/hook_property.py``, whose
docstring lists what its random programs do on two interleaved threads, deep copies and modules calling
themselves among them): the counter is never negative, always equals what its oracle simulates (the fix's
record for the modules it covers, the library's own arithmetic for those it cannot), every self-call reads
its weights once and ends where the fix promises, and every span switches off and reports exactly what the
oracle says. Its control, with the fix switched off, must be falsified. A mutation of the span rule (a span
switching off every switch-on of its thread), of the re-entry rule, or of the rule for an off hook without
a switch-on is falsified too. The tests below it each pin one behaviour that the property does not reach:
a direct call of bitsandbytes' functions runs the library's own arithmetic, the off hook's clamp, and
``reset()`` forgetting the fix's switch-ons.
"""

from __future__ import annotations

import os

import pytest
from conftest import AFFECTED, FIX, SCENARIOS, run_code, run_python

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

PROPERTY = SCENARIOS / "hook_property.py"
EXAMPLES = os.environ.get("BNB_GC_FIX_PROPERTY_EXAMPLES", "300")


def test_the_liveness_rule_holds_for_random_programs_on_two_threads() -> None:
    # The process starts with the switch off and turns the fix on late (the scenario's docstring).
    result = run_python([str(PROPERTY), "--examples", EXAMPLES, "--activate"], switch="0", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"PROPERTY HELD over {EXAMPLES} programs" in result.stdout


def test_the_liveness_rule_control_is_falsified_without_the_fix() -> None:
    # Falsified is all it must be: the first falsifying program ends it, unshrunk.
    result = run_python([str(PROPERTY), "--examples", EXAMPLES, "--no-shrink"], switch="0", timeout=900)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PROPERTY FAILED" in result.stdout


# --- bitsandbytes' own functions called directly ------------------------------------------------

DIRECT = """
import torch
import torch.nn.utils.parametrize as P
import bnb_gc_fix
from bitsandbytes.nn import parametrize
module = torch.nn.Module()
seen = []
for _ in range(2):
    parametrize._enable_parametrization_cache(module, ())
seen.append(int(P._cache_enabled))
P._cache["key"] = torch.ones(1)
for _ in range(3):
    parametrize._disable_parametrization_cache(module, (), None)  # called directly, as a user might
    seen.append([int(P._cache_enabled), len(P._cache)])
print(json.dumps({"seen": seen, "fixed": bnb_gc_fix.status().fixed}))
"""


def test_a_direct_call_of_bitsandbytes_functions_runs_the_librarys_own_arithmetic() -> None:
    out = run_code(DIRECT, prelude="scenarios", switch=FIX).last_json
    assert out["fixed"] is True
    # A module of no library's: +1 a call, then 2 -> 1 (the cache kept), 1 -> 0 (emptied), 0 -> -1
    # (bitsandbytes 0.48-0.49's own arithmetic, unclamped: the fix keeps no record of such a module).
    assert out["seen"] == [2, [1, 1], [0, 0], [-1, 0]]


def test_a_direct_call_control_runs_the_same_arithmetic_on_an_affected_bitsandbytes() -> None:
    out = run_code(DIRECT, prelude="scenarios", switch="0").last_json
    # The third call goes below zero on an affected bitsandbytes (0.48-0.49: no clamp) and stays at zero on
    # a fixed one (0.50 clamps it itself); the cache is empty either way.
    third = [-1, 0] if AFFECTED else [0, 0]
    assert out["seen"] == [2, [1, 1], [0, 0], third]
    assert out["fixed"] is False


# --- reset() forgets the fix's switch-ons ---------------------------------------------------------

RESET_FORGETS = """
import torch
import torch.nn.utils.parametrize as P
import bnb_gc_fix, quantized
module = quantized.make()
x = torch.randn(2, 64)
quantized.interrupted_forward(module, x)  # the fix's switch-on, left by the KeyboardInterrupt
released = bnb_gc_fix.reset()
with P.cached():  # another holder, after the reset
    module(x)  # the fix must not switch the P.cached() block's off as if it were its own left one
    inside = int(P._cache_enabled)
print(json.dumps({"released": released, "inside": inside, "after": int(P._cache_enabled)}))
"""


def test_reset_forgets_the_fixs_switch_ons_so_none_switches_off_another_holders() -> None:
    out = run_code(RESET_FORGETS, prelude="scenarios", switch=FIX).last_json
    assert out == {"released": 1, "inside": 1, "after": 0}


# --- a second, independent test for each once singly-guarded behaviour --------------------------

EXIT_WITHOUT_HOLD = """
import torch
import torch.nn.utils.parametrize as P
import bnb_gc_fix, quantized
module = quantized.make()
forward_hook = next(iter(module._forward_hooks.values()))
with P.cached():
    forward_hook(module, (), None)  # an off hook with no switch-on of its own (its pre-hook never ran)
    inside = int(P._cache_enabled)
after = int(P._cache_enabled)
module(torch.randn(2, 64))  # and it took nothing away from the fix: a forward still pairs
print(json.dumps({"inside": inside, "after": after, "held": int(P._cache_enabled)}))
"""


def test_an_off_hook_without_a_switch_on_switches_nothing_off() -> None:
    out = run_code(EXIT_WITHOUT_HOLD, prelude="scenarios", switch=FIX).last_json
    assert out == {"inside": 1, "after": 0, "held": 0}


# Code of someone else's that puts torch's counter to 0 inside a quantized forward (a library resetting
# the cache by hand): at the forward's end the fix's off hook switches its call's off, clamped at 0;
# the control, bitsandbytes' own plain pair, goes to -1.
ZEROED_INSIDE_A_FORWARD = """
import torch
import torch.nn.utils.parametrize as P
import bnb_gc_fix, quantized
module = quantized.make(params=1)
module.trainable.register_forward_hook(lambda *_: setattr(P, "_cache_enabled", 0))
module(torch.randn(2, 64))
print(json.dumps(quantized.counter()))
"""


def test_the_off_hook_clamps_a_counter_zeroed_inside_the_forward() -> None:
    assert run_code(ZEROED_INSIDE_A_FORWARD, prelude="scenarios", switch=FIX).last_json == 0
    control = run_code(ZEROED_INSIDE_A_FORWARD, prelude="scenarios", switch="0").last_json
    assert control == (-1 if AFFECTED else 0)  # 0.50 clamps its own


COLLECTED = """
import gc, torch, weakref
import bnb_gc_fix, quantized
x = torch.randn(2, 64)
counters = []
for params in (1, 3):
    module = quantized.make(params=params)
    quantized.interrupted_forward(module, x)
    counters.append(quantized.counter())
    ref = weakref.ref(module)
    del module
    gc.collect()
    counters.append([ref() is None, quantized.counter()])
print(json.dumps(counters))
"""


def test_a_collected_module_switches_off_what_a_ctrl_c_left() -> None:
    out = run_code(COLLECTED, prelude="scenarios", switch=FIX).last_json
    assert out == [1, [True, 0], 1, [True, 0]]  # one pair per module, however many parameters


def test_a_collected_module_control_keeps_what_a_ctrl_c_left() -> None:
    out = run_code(COLLECTED, prelude="scenarios", switch="0").last_json
    assert out[0] == 1 and out[1] == [True, 1] and out[3][1] > 1
