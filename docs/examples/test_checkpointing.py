"""A checkpointed step through a module quantized by ``replace_parameter_4bit``, in a test that never
looks at torch's parametrization cache: what docs/pytest-plugin.md runs the plugin on."""

import torch
from bitsandbytes.nn.parametrize import replace_parameter_4bit
from torch.utils.checkpoint import checkpoint


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()  # the last tensor checkpointing saves is made here


def test_checkpointed_step() -> None:
    head, experts = torch.nn.Linear(64, 64), Experts()
    replace_parameter_4bit(experts, "weight", quant_type="nf4")
    x = torch.randn(8, 64)
    for _ in range(3):
        checkpoint(lambda v: experts(head(v).relu()), x, use_reentrant=False).sum().backward()


def test_next() -> None:
    pass
