"""The small random model ``bnb-gc-fix check`` trains: layers of a trainable router and fused 3-D experts
quantized by bitsandbytes' ``replace_parameter_4bit``, each layer checkpointed non-reentrantly."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from bnb_gc_fix import cache

LAYERS = 3
EXPERTS = 8
WIDTH = 64
HIDDEN = 128
RANK = 4
NAMES = ("up", "down")  # the experts' two fused weights


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH) * 0.05)
        self.down = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) * 0.05)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        inner = torch.einsum("td,ehd->teh", x, self.up).relu()
        return (torch.einsum("teh,edh->ted", inner, self.down) * weights.unsqueeze(-1)).sum(1)


class LowRank(nn.Module):
    """A trainable low-rank update of a quantized weight: a parametrization over bitsandbytes' own."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(EXPERTS, rows, RANK) * 0.05)
        self.b = nn.Parameter(torch.zeros(EXPERTS, RANK, columns))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.a @ self.b


class Adapter(nn.Module):
    """The experts with a low-rank update over each weight, put on for each forward and taken off after,
    as PEFT's ``target_parameters`` does (torch computes the weight once to check a new parametrization)."""

    def __init__(self, experts: Experts) -> None:
        super().__init__()
        self.experts = experts
        self.updates = nn.ModuleDict({name: LowRank(*getattr(experts, name).shape[1:]) for name in NAMES})

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        for name, update in self.updates.items():
            parametrize.register_parametrization(self.experts, name, update)
        try:
            return self.experts(x, weights)  # type: ignore[no-any-return]
        finally:
            for name in self.updates:
                self.experts.parametrizations[name].pop(-1)  # type: ignore[index,union-attr]


class Layer(nn.Module):
    def __init__(self, adapted: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = Experts()
        self.adapted = adapted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        experts: nn.Module = self.adapter if self.adapted else self.experts  # type: ignore[assignment]
        return x + experts(h, self.router(h).softmax(-1))  # type: ignore[no-any-return]


def build(replace_parameter_4bit: Any, device: str, adapted: bool) -> nn.ModuleList:
    """The model, its experts quantized; the routers trainable, and the adapters' updates if ``adapted``."""
    torch.manual_seed(0)
    model = nn.ModuleList(Layer(adapted) for _ in range(LAYERS)).to(device)
    for layer in model:
        for name in NAMES:
            replace_parameter_4bit(layer.experts, name, quant_type="nf4")
        if adapted:
            layer.adapter = Adapter(layer.experts).to(device)  # type: ignore[arg-type]
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".router." in name or ".updates." in name)
    return model


def train(model: nn.ModuleList, device: str, steps: int, done: list[tuple[int, int, float]]) -> None:
    """Train with AdamW, each layer checkpointed non-reentrantly; after each step, append torch's counter,
    the bytes its cache holds, and the loss to ``done``."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(32, WIDTH, device=device)
    for _ in range(steps):
        h = x
        for layer in model:
            h = checkpoint(layer, h, use_reentrant=False)
        loss = h.pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done.append((cache.counter(), cache.cached_bytes(), float(loss.item())))
