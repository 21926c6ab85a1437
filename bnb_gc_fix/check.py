"""``bnb-gc-fix check``: the bug report's ingredients on a small random model, in-process: quantized
3-D expert parameters (``replace_parameter_4bit``), non-reentrant checkpointing of each layer, a
trainable router and AdamW.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from _bnb_gc_fix import BITSANDBYTES, cache


class CannotRunError(Exception):
    """The check cannot run here; the message says what happened and what to do."""


@dataclass(frozen=True)
class Step:
    step: int
    counter: int
    cache_bytes: int
    loss: float


@dataclass(frozen=True)
class CheckResult:
    device: str
    steps: list[Step] = field(default_factory=list)

    @property
    def protected(self) -> bool:
        """The counter and the cache were back to zero after every step."""
        return all(s.counter == 0 and s.cache_bytes == 0 for s in self.steps)

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "protected": self.protected, "steps": [asdict(s) for s in self.steps]}


def _imports() -> tuple[Any, Any]:
    """torch and bitsandbytes' parametrize module, or a CannotRunError saying why not."""
    from bnb_gc_fix.decide import MIN_TORCH, before_parametrize, no_parametrize, torch_too_old
    from bnb_gc_fix.installed import missing, try_import

    torch, problem = try_import("torch")
    if torch is None:
        install = f"install torch (and bitsandbytes>={BITSANDBYTES.first_affected})"
        do = install if missing("torch") else "repair the torch installation"
        raise CannotRunError(f"{problem}; {do} to run the check")
    if torch_too_old(str(torch.__version__)):
        raise CannotRunError(
            f"torch {torch.__version__} is too old: the fix needs torch >= {MIN_TORCH} "
            "(forward hooks that run even when a forward raises); upgrade torch"
        )
    bitsandbytes, problem = try_import("bitsandbytes")
    if bitsandbytes is None:
        if missing("bitsandbytes"):
            raise CannotRunError(
                f"{problem}; install bitsandbytes>={BITSANDBYTES.first_affected} to run the check"
            )
        raise CannotRunError(
            f"{problem}; this is a problem of the bitsandbytes installation (its CUDA libraries, "
            "for example), not the leak"
        )
    version = str(getattr(bitsandbytes, "__version__", "?"))
    if before_parametrize(version):
        raise CannotRunError(f"{no_parametrize(version)}; there is nothing to check")
    parametrize, problem = try_import(BITSANDBYTES.module)
    if parametrize is None:
        raise CannotRunError(f"{problem}; there is nothing to check")
    return torch, parametrize


def run(device: str | None = None, steps: int = 4) -> CheckResult:
    """Train the synthetic model for ``steps`` steps and record the cache after each. Every failure
    is a :class:`CannotRunError`, so the exit status can never be mistaken for "leak observed"."""
    torch, parametrize = _imports()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and getattr(torch.version, "cuda", None) is None:
        raise CannotRunError(
            f"--device cuda was asked for, but this torch ({torch.__version__}) is a build without "
            "CUDA support; run with --device cpu, or install a CUDA build of torch"
        )
    elif device == "cuda" and not torch.cuda.is_available():
        raise CannotRunError(
            "--device cuda was asked for, but no CUDA device is available here (check the driver "
            "and CUDA_VISIBLE_DEVICES); run with --device cpu"
        )
    try:
        return _train(torch, parametrize, device, steps)
    except Exception as error:
        raise CannotRunError(
            f"the synthetic model failed on {device} ({type(error).__name__}: {error}); this says "
            "nothing about the leak: it is a problem of this torch/bitsandbytes installation"
        ) from error


_LAYERS = 3
_EXPERTS = 8
_WIDTH = 64
_HIDDEN = 128


def _model(torch: Any, parametrize: Any, device: str) -> Any:
    """A small random MoE: each layer a trainable router and fused 3-D experts quantized to 4 bits by
    ``replace_parameter_4bit`` (bitsandbytes' hooks sit on the experts' forward)."""
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Parameter(torch.randn(_EXPERTS, _HIDDEN, _WIDTH) * 0.05)
            self.down = nn.Parameter(torch.randn(_EXPERTS, _WIDTH, _HIDDEN) * 0.05)

        def forward(self, x: Any, weights: Any) -> Any:
            inner = torch.einsum("td,ehd->teh", x, self.up).relu()
            return (torch.einsum("teh,edh->ted", inner, self.down) * weights.unsqueeze(-1)).sum(1)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(_WIDTH)
            self.router = nn.Linear(_WIDTH, _EXPERTS)
            self.experts = Experts()

        def forward(self, x: Any) -> Any:
            h = self.norm(x)
            return x + self.experts(h, self.router(h).softmax(-1))

    torch.manual_seed(0)
    model = nn.ModuleList(Layer() for _ in range(_LAYERS)).to(device)
    for layer in model:
        parametrize.replace_parameter_4bit(layer.experts, "up", quant_type="nf4")
        parametrize.replace_parameter_4bit(layer.experts, "down", quant_type="nf4")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".router." in name)
    return model


def _train(torch: Any, parametrize: Any, device: str, steps: int) -> CheckResult:
    """Train the model with each layer checkpointed non-reentrantly; record the cache after each step."""
    from torch.utils.checkpoint import checkpoint

    model = _model(torch, parametrize, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(32, _WIDTH, device=device)

    result = CheckResult(device=device)
    for step in range(1, steps + 1):
        h = x
        for layer in model:
            h = checkpoint(layer, h, use_reentrant=False)
        loss = h.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = Step(
            step=step, counter=cache.counter(), cache_bytes=cache.cached_bytes(), loss=float(loss.item())
        )
        result.steps.append(record)
    return result
