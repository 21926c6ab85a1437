"""``bnb-gc-fix check``: both faces of the leak, on a small random model in this process, with the fix as it
stands here. Nothing is downloaded.

The model: layers of a trainable router and fused 3-D experts quantized by ``replace_parameter_4bit``,
each layer checkpointed non-reentrantly. Trained twice:

* its routers alone (the bug report's shape): without the fix the cache stays switched on, and grows;
* with an adapter trained through the quantized experts, as PEFT's ``target_parameters`` does it: a
  low-rank update put over each expert weight for each forward and taken off after (torch computes the
  weight once to check a new parametrization). Without the fix the first backward dies with torch's
  ``CheckpointError``: the recompute starts with the cache left on, finds the weight cached, and saves
  fewer tensors than the forward did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bnb_gc_fix.installed import try_import
from bnb_gc_fix.ledger import reset
from bnb_gc_fix.libraries import BITSANDBYTES
from bnb_gc_fix.releases import MIN_TORCH, release
from bnb_gc_fix.status import status


class CannotRunError(Exception):
    """The check cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class Step:
    step: int
    counter: int
    cache_bytes: int
    loss: float


@dataclass(frozen=True)
class CheckResult:
    device: str
    state: str  # status().state while the check's first model was alive: the fix's state for it
    status_line: str  # status()'s first line then, as `bnb-gc-fix status` and status() print it
    steps: list[Step] = field(default_factory=list)  # the routers trained alone: the cache after each step
    adapter_steps: int = 0  # the steps that ran with the adapter trained through the experts
    adapter_error: str | None = None  # what stopped them ("CheckpointError: ...")

    @property
    def cache_left_on(self) -> bool:
        return any(step.counter != 0 or step.cache_bytes != 0 for step in self.steps)

    @property
    def protected(self) -> bool:
        return not self.cache_left_on and self.adapter_error is None

    def as_dict(self) -> dict[str, Any]:
        facts = asdict(self)
        facts.update(protected=self.protected, cache_left_on=self.cache_left_on)
        return facts


def _imports() -> tuple[Any, Any]:
    """torch and bitsandbytes' parametrize module, or a CannotRunError that says why not."""
    torch, problem = try_import("torch")
    if torch is None:
        raise CannotRunError(f"{problem}; {_remedy(problem, 'torch')}")
    torch_release = release(torch.__version__)
    if torch_release is not None and torch_release < MIN_TORCH:
        raise CannotRunError(
            f"torch {torch.__version__} is too old: the fix needs torch >= {MIN_TORCH} (forward hooks that "
            "run when a forward raises); upgrade torch"
        )
    bitsandbytes, problem = try_import("bitsandbytes")
    if bitsandbytes is None:
        raise CannotRunError(f"{problem}; {_remedy(problem, 'bitsandbytes')}")
    parametrize, problem = try_import(BITSANDBYTES.module_name)
    if parametrize is None:
        named = f"bitsandbytes {getattr(bitsandbytes, '__version__', '?')}"
        raise CannotRunError(
            f"{named} has no {BITSANDBYTES.module_name} ({problem}): it cannot leak this way, and there is "
            "nothing to check"
        )
    return torch, parametrize


def _remedy(problem: str | None, name: str) -> str:
    if problem is not None and problem.endswith("is not installed"):
        return f"install {name} to run the check (bitsandbytes >= {BITSANDBYTES.first_affected})"
    return f"this is a problem of the {name} installation (its CUDA libraries, for example), not the leak"


def _device(torch: Any, asked: str | None) -> str:
    if asked is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if asked == "cuda" and getattr(torch.version, "cuda", None) is None:
        raise CannotRunError(
            f"--device cuda was asked for, but this torch ({torch.__version__}) is a build without CUDA "
            "support; run with --device cpu, or install a CUDA build of torch"
        )
    if asked == "cuda" and not torch.cuda.is_available():
        raise CannotRunError(
            "--device cuda was asked for, but no CUDA device is available here (check the driver and "
            "CUDA_VISIBLE_DEVICES); run with --device cpu"
        )
    return asked


def run(device: str | None = None, steps: int = 4) -> CheckResult:
    """Train the model both ways for ``steps`` steps. Every failure but the leak's is a CannotRunError."""
    torch, parametrize = _imports()
    device = _device(torch, device)
    try:
        return _train_both_ways(parametrize.replace_parameter_4bit, device, steps)
    except Exception as error:
        raise CannotRunError(
            f"the check's small model failed on {device} ({type(error).__name__}: {error}); this says "
            "nothing about the leak: it is a problem of this torch or bitsandbytes installation"
        ) from error
    finally:
        reset()  # the check leaves nothing switched on in this process


def _train_both_ways(replace_parameter_4bit: Any, device: str, steps: int) -> CheckResult:
    from torch.utils.checkpoint import CheckpointError

    from bnb_gc_fix import check_model

    frozen: list[tuple[int, int, float]] = []
    model = check_model.build(replace_parameter_4bit, device, adapted=False)
    check_model.train(model, device, steps, frozen)
    alive = status()
    reset()  # the second run starts clean, whatever the first left
    adapted: list[tuple[int, int, float]] = []
    error = None
    try:
        model = check_model.build(replace_parameter_4bit, device, adapted=True)
        check_model.train(model, device, steps, adapted)
    except CheckpointError as failure:
        error = f"CheckpointError: {str(failure).splitlines()[0]}"
    cache_after = [Step(number, *after) for number, after in enumerate(frozen, start=1)]
    return CheckResult(
        device, alive.state, alive.state_line(), cache_after, adapter_steps=len(adapted), adapter_error=error
    )
