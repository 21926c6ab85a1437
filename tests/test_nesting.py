"""Self-calls: a module that calls itself, to any depth, unpacks its weights as often as the control does,
and what a Ctrl-C leaves inside it is switched off at its next forward.

bitsandbytes' pair switches the cache on at the outermost call of a quantized module and leaves it on until
that call ends, so a recursive forward dequantizes each weight once. The fix does the same: where a module
is entered again on a thread that has a switch-on for it, it reads the thread's frames, and where another
call of the module still runs further out, the inner call nests in it (the cache stays on, unchanged).
Where none runs, the switch-on is left over (a Ctrl-C, or a second pre-hook of the same call) and is
switched off first. Each test runs beside its control (``BNB_GC_FIX=0``: bitsandbytes 0.49.2's own hooks).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import AFFECTED, FIX, run_code

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

# A quantized module whose forward calls itself down to sys.argv[1] levels. One JSON line: the
# dequantizations (calls of the parametrization), the output's sum, its gradient's, the counter after the
# backward.
RECURSIVE = """
import torch
from torch import nn
depth = int(sys.argv[1])
sys.setrecursionlimit(20 * depth + 1000)
import quantized

class Recursive(nn.Module):
    def __init__(self):
        super().__init__()
        self.names = ["w0"]
        self.w0 = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.trainable = nn.Linear(16, 16)

    def forward(self, x, level=0):
        x = torch.tanh(self.trainable(x) @ self.w0.t())
        if level < depth:
            x = self(x, level + 1)
        return x

torch.manual_seed(0)
module = quantized.quantize(Recursive())
dequantized = []
module.parametrizations.w0[0].register_forward_hook(lambda *args: dequantized.append(1))
output = module(torch.randn(4, 16))
output.sum().backward()
print(json.dumps({
    "dequantized": len(dequantized),
    "output": round(float(output.sum()), 5),
    "gradient": round(float(module.trainable.weight.grad.sum()), 5),
    "counter": quantized.counter(),
    "fix": "bnb_gc_fix" in sys.modules,
}))
"""


def _recursive(depth: int, switch: str | None) -> dict[str, Any]:
    return dict(run_code(RECURSIVE, str(depth), prelude="scenarios", switch=switch).last_json)


@pytest.mark.parametrize("depth", [3, 500])
def test_a_recursive_model_computes_and_unpacks_what_the_control_does_and_leaves_nothing(depth: int) -> None:
    fixed = _recursive(depth, FIX)
    control = _recursive(depth, "0")
    assert fixed["fix"] is True and control["fix"] is False
    assert (fixed["output"], fixed["gradient"]) == (control["output"], control["gradient"])
    assert fixed["counter"] == control["counter"] == 0
    assert control["dequantized"] == 1  # the cache stays on from the outermost call to its end
    assert fixed["dequantized"] == 1  # the inner calls nest in the outer one (was depth + 1)


# Issue 55: bitsandbytes' own unpacking function (bitsandbytes.functional.dequantize_4bit) counted, for a
# block that calls itself sys.argv[1] levels deep inside its forward, one forward without grad.
UNPACKS = """
import torch
from torch import nn
import bitsandbytes.functional as F
from bitsandbytes.nn.parametrize import replace_parameter_4bit
import torch.nn.utils.parametrize as P
unpacks = []
unpack = F.dequantize_4bit
F.dequantize_4bit = lambda *args, **kwargs: unpacks.append(1) or unpack(*args, **kwargs)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))

    def forward(self, x, depth):
        x = x @ self.w
        if depth:
            x = self(x, depth - 1)
        return x @ self.w.t()

torch.manual_seed(0)
block = Block()
replace_parameter_4bit(block, "w")
with torch.no_grad():
    for _ in range(2):
        block(torch.randn(2, 64), int(sys.argv[1]))
print(json.dumps({"unpacks": len(unpacks), "counter": int(P._cache_enabled), "cached": len(P._cache)}))
"""


@pytest.mark.parametrize("depth", [1, 2])
def test_a_self_call_unpacks_its_weight_as_often_as_the_control(depth: int) -> None:
    fixed = run_code(UNPACKS, str(depth), prelude="scenarios", switch=FIX).last_json
    control = run_code(UNPACKS, str(depth), prelude="scenarios", switch="0").last_json
    assert control == {"unpacks": 2, "counter": 0, "cached": 0}  # once per outer forward
    assert fixed == control  # d75b8f8: 6 and 10 unpacks (3 and 5 a forward)


# A block that calls itself once; a KeyboardInterrupt raised inside its inner call ("inner"), or inside its
# outer call after the inner one returned ("outer"), caught by the caller; then another forward of it.
# One JSON line: the counter after the Ctrl-C, then the counter and the cache's entries after the forward.
CTRL_C_IN_A_SELF_CALL = """
import torch
import torch.nn.utils.parametrize as P
import quantized

class CallsItself(quantized.Quantized):
    def forward(self, x, level=0, stop=None):
        out = super().forward(x)
        if level == 0:
            out = out + self(x, 1, stop)
            if stop == "outer":
                raise KeyboardInterrupt  # in the outer call, after its inner call returned
        elif stop == "inner":
            raise KeyboardInterrupt  # inside the inner call
        return out

torch.manual_seed(0)
module = quantized.quantize(CallsItself(params=1))
x = torch.randn(2, 64)
try:
    module(x, 0, sys.argv[1])
except KeyboardInterrupt:
    pass
stopped = quantized.counter()
module(x)
print(json.dumps({"stopped": stopped, "after": quantized.counter(), "cached": len(P._cache)}))
"""


@pytest.mark.parametrize("where", ["inner", "outer"])
def test_a_ctrl_c_inside_a_self_call_is_switched_off_at_the_next_forward(where: str) -> None:
    fixed = run_code(CTRL_C_IN_A_SELF_CALL, where, prelude="scenarios", switch=FIX).last_json
    assert fixed == {"stopped": 1, "after": 0, "cached": 0}  # the module's one switch-on, then none


@pytest.mark.parametrize("where", ["inner", "outer"])
def test_a_ctrl_c_inside_a_self_call_control_stays_on(where: str) -> None:
    control = run_code(CTRL_C_IN_A_SELF_CALL, where, prelude="scenarios", switch="0").last_json
    stuck = 2 if where == "inner" else 1  # each call whose plain off hook torch skipped
    assert control["stopped"] == control["after"] == stuck and control["cached"] > 0


# A module that calls itself; its first inner call is stopped by a KeyboardInterrupt, which the outer call
# catches; a second inner call follows. The counter after each inner call, after the outer call, and after
# one more forward.
SELF_CALLS = """
import torch
import quantized

class CallsItself(quantized.Quantized):
    def forward(self, x, depth=0):
        out = super().forward(x)
        if depth == 0:
            try:
                self(x, 1)
            except KeyboardInterrupt:
                pass
            seen.append(quantized.counter())
            out = out + self(x, 2)
            seen.append(quantized.counter())
        elif depth == 1:
            raise KeyboardInterrupt
        return out

seen = []
torch.manual_seed(0)
module = quantized.quantize(CallsItself(params=1))
x = torch.randn(2, 64)
module(x)
seen.append(quantized.counter())
module(x, 2)  # its next forward
seen.append(quantized.counter())
print(json.dumps(seen))
"""


def test_a_module_calling_itself_keeps_its_one_switch_on_and_never_goes_below_zero() -> None:
    # The inner calls nest in the outer one: the counter stays at its 1 through them. What the
    # KeyboardInterrupt left (the inner call's entry, holding the outer's switch-on) stays after the outer
    # call returns, as in the control, and goes at the module's next forward.
    assert run_code(SELF_CALLS, prelude="scenarios", switch=FIX).last_json == [1, 1, 1, 0]


def test_a_module_calling_itself_control_leaks() -> None:
    assert run_code(SELF_CALLS, prelude="scenarios", switch="0").last_json == [2, 2, 1, 1]


# Issue 55: a module quantized before the fix went in (two plain pairs), whose second pre-hook another tool
# wrapped (a functools.partial of it in the module's hook dictionary), then covered at its first forward:
# the bare pre-hook and the wrapper stay and share one off hook, so each forward calls the fixed pre-hook
# twice. The second call is no call of itself (none runs further out): it switches the first one's off
# and on anew. The counter after each of three forwards, then after each of three checkpointed steps.
SECOND_PRE_HOOK = """
import functools, torch
import quantized
module = quantized.make(params=2)
hooks = module._forward_pre_hooks
second = list(hooks)[1]
hooks[second] = functools.partial(hooks[second])
import bnb_gc_fix
x = torch.randn(2, 64)
forwards = []
for _ in range(3):
    module(x)
    forwards.append(quantized.counter())
state = bnb_gc_fix.status().state if bnb_gc_fix.status().fixed else None
print(json.dumps({"forwards": forwards, "steps": quantized.checkpointed_counters(module), "state": state}))
"""


def test_a_second_pre_hook_of_the_same_call_ends_every_step_at_zero() -> None:
    fixed = run_code(SECOND_PRE_HOOK, prelude="scenarios-without-startup-hook", switch=FIX).last_json
    control = run_code(SECOND_PRE_HOOK, prelude="scenarios-without-startup-hook", switch="0").last_json
    # Built the naive way (a second pre-hook nesting in its own call): 1 more a step.
    assert fixed == {"forwards": [0, 0, 0], "steps": [0, 0, 0], "state": "protected"}
    assert control["forwards"] == [0, 0, 0] and control["state"] is None
    if AFFECTED:
        assert control["steps"] == [2, 4, 6]  # each recompute's two plain pairs


# A known limit (docs/how-it-works.md): a pre-hook in front of bitsandbytes' refuses (raises) an inner
# call of a module calling itself, and the outer forward catches it. torch calls the refused call's off
# hook (always called), which takes the outer call's switch-on for its own: the cache is off for the rest
# of the outer forward, which unpacks its weight again. More computation, never a leak: both runs end at 0
# with nothing cached. One JSON line: the counter after the refused call, the unpacks, the counter after.
REFUSED_INNER_CALL = """
import torch
import torch.nn.utils.parametrize as P
import bitsandbytes.functional as F
import quantized
unpacks = []
unpack = F.dequantize_4bit
F.dequantize_4bit = lambda *args, **kwargs: unpacks.append(1) or unpack(*args, **kwargs)
inside = []

class CallsItself(quantized.Quantized):
    def forward(self, x, level=0):
        out = super().forward(x)
        if level == 0:
            try:
                self(x, 1)
            except ValueError:
                pass
            inside.append(int(P._cache_enabled))
            out = out + super().forward(x)  # the weight again
        return out

def refuse_inner_calls(module, args):
    if len(args) > 1:
        raise ValueError("refused")

module = quantized.quantize(CallsItself())
module.register_forward_pre_hook(refuse_inner_calls, prepend=True)
with torch.no_grad():
    module(torch.randn(2, 64))
print(json.dumps({"inside": inside, "unpacks": len(unpacks), "counter": int(P._cache_enabled),
                  "cached": len(P._cache)}))
"""


def test_a_refused_inner_call_of_a_self_call_unpacks_again_and_leaves_nothing() -> None:
    fixed = run_code(REFUSED_INNER_CALL, prelude="scenarios", switch=FIX).last_json
    control = run_code(REFUSED_INNER_CALL, prelude="scenarios", switch="0").last_json
    assert control == {"inside": [1], "unpacks": 1, "counter": 0, "cached": 0}
    assert fixed == {"inside": [0], "unpacks": 2, "counter": 0, "cached": 0}  # the known limit
