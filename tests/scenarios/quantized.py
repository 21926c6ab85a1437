"""Small modules with parameters quantized by bitsandbytes' ``replace_parameter_4bit``.

Imported by test snippets that run in fresh interpreters (``sys.path`` gets this folder).
"""

from __future__ import annotations

from typing import Any

import torch
from bitsandbytes.nn import parametrize as bnb_parametrize
from torch import nn


class Quantized(nn.Module):
    """``y = x @ w1.T (@ w2.T)``, its weights 4-bit parametrized; optionally raises mid-forward."""

    def __init__(self, width: int = 64, params: int = 1) -> None:
        super().__init__()
        self.names = [f"w{i}" for i in range(params)]
        for name in self.names:
            setattr(self, name, nn.Parameter(torch.randn(width, width) * 0.05))
        self.interrupt: type[BaseException] | None = None
        self.trainable = nn.Linear(width, width)

    def forward(self, x: Any, fail: bool = False) -> Any:
        x = self.trainable(x)
        for name in self.names:
            x = x @ getattr(self, name).t()
            if self.interrupt is not None:
                raise self.interrupt()
            if fail:
                raise RuntimeError("failing mid-forward, after the cache was switched on")
        return x


def quantize(module: Quantized) -> Quantized:
    for name in module.names:
        bnb_parametrize.replace_parameter_4bit(module, name, quant_type="nf4")
    return module


def make(width: int = 64, params: int = 1) -> Quantized:
    torch.manual_seed(0)
    return quantize(Quantized(width, params))


def noted(module: Any, inputs: Any, output: Any) -> None:
    """A user's own forward hook (registered always called): counts its calls on the module."""
    module.noted = getattr(module, "noted", 0) + 1


def interrupted_forward(module: Quantized, x: Any) -> int:
    """One forward left by a ``KeyboardInterrupt`` inside it (torch runs no forward hook then).

    Returns the counter right after it; the module forwards normally again afterwards.
    """
    module.interrupt = KeyboardInterrupt
    try:
        module(x)
    except KeyboardInterrupt:
        pass
    finally:
        module.interrupt = None
    return counter()


def counter() -> int:
    import torch.nn.utils.parametrize as P

    return int(P._cache_enabled)


def reset() -> None:
    """Put torch's counter back to 0 and empty its cache, as a fresh interpreter has them."""
    import torch.nn.utils.parametrize as P

    P._cache_enabled = 0
    P._cache = {}


def checkpointed_counters(module: Any, steps: int = 3) -> list[int]:
    """Train ``module`` behind a trainable head for ``steps`` steps, each under non-reentrant
    checkpointing (what leaks); torch's counter after each step."""
    from torch.utils.checkpoint import checkpoint

    head = nn.Linear(64, 64)
    x = torch.randn(8, 64)
    counters = []
    for _ in range(steps):
        output = checkpoint(lambda v: module(head(v).relu()), x, use_reentrant=False)
        output.pow(2).mean().backward()
        counters.append(counter())
    return counters
