"""Self-calls: a module that calls itself, at any depth and however ``Module._call_impl`` is wrapped.

bitsandbytes' pair switches the cache on at the outermost call of a quantized module and leaves it on
until that call ends, so a recursive forward dequantizes each weight once. The gate must do the same:
never more dequantizations than the control (``BNB_GC_FIX=0``), the same outputs, and every hold given
back at the end. Two hosts once broke that: a recursive model (the gate re-read the stack at every
level), and a ``(*args, **kwargs)`` wrapper of ``Module._call_impl`` installed before the package (the
gate did not recognise the wrapped calls as live, gave the outer call's hold back, and dequantized again
at every level). What each costs is measured in ``benchmarks/nesting.py``; here, what each computes.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import FIX, run_code

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

# A quantized module whose forward calls itself down to sys.argv[1] levels; sys.argv[2] == "wrapped"
# wraps Module._call_impl before bitsandbytes (and so the package) is imported. One JSON line: the
# dequantizations (calls of the parametrization), the output's sum, the counter after the backward.
RECURSIVE = """
import torch
from torch import nn
depth = int(sys.argv[1])
sys.setrecursionlimit(20 * depth + 1000)
if sys.argv[2] == "wrapped":
    original = nn.Module._call_impl
    def wrapper(*args, **kwargs):  # as a profiler or framework wraps it: no `self` parameter
        return original(*args, **kwargs)
    nn.Module._call_impl = wrapper
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
    "output": round(float(output.sum()), 6),
    "counter": quantized.counter(),
    "fix": "bnb_gc_fix" in sys.modules,
}))
"""


def _recursive(depth: int, call_impl: str, switch: str | None) -> dict[str, Any]:
    return dict(run_code(RECURSIVE, str(depth), call_impl, prelude="scenarios", switch=switch).last_json)


@pytest.mark.parametrize("depth", [3, 10, 100, 500])
def test_a_recursive_model_dequantizes_no_more_than_the_control_at_every_depth(depth: int) -> None:
    fixed = _recursive(depth, "plain", FIX)
    control = _recursive(depth, "plain", "0")
    assert fixed["fix"] is True and control["fix"] is False
    assert control["dequantized"] == 1  # the cache stays on from the outermost call to its end
    assert fixed["dequantized"] == control["dequantized"]
    assert fixed["output"] == control["output"]
    assert fixed["counter"] == control["counter"] == 0


def test_a_wrapped_call_impl_installed_before_the_package_dequantizes_no_more_than_the_control() -> None:
    fixed = _recursive(3, "wrapped", FIX)
    control = _recursive(3, "wrapped", "0")
    assert fixed["fix"] is True and control["fix"] is False
    assert control["dequantized"] == 1
    assert fixed["dequantized"] == control["dequantized"]
    assert fixed["output"] == control["output"]
    assert fixed["counter"] == control["counter"] == 0
