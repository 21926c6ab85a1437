"""Self-calls: a module that calls itself, to any depth, never leaks and never goes below zero.

bitsandbytes' pair switches the cache on at the outermost call of a quantized module and leaves it on
until that call ends, so a recursive forward dequantizes each weight once. The fix reads no stack to
tell a call that is still running from one a Ctrl-C ended: a module entered again on a thread that holds
it gives that hold back first. So in a module that calls itself each level dequantizes its weights again
(the accepted cost: more computation, never a leak); the outputs and the gradients are the control's.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import FIX, run_code

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
def test_a_recursive_model_computes_what_the_control_does_and_leaves_nothing(depth: int) -> None:
    fixed = _recursive(depth, FIX)
    control = _recursive(depth, "0")
    assert fixed["fix"] is True and control["fix"] is False
    assert (fixed["output"], fixed["gradient"]) == (control["output"], control["gradient"])
    assert fixed["counter"] == control["counter"] == 0
    assert control["dequantized"] == 1  # the cache stays on from the outermost call to its end
    assert fixed["dequantized"] == depth + 1  # once a level: the cost of reading no stack
