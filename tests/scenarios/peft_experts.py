"""PEFT LoRA on a tiny OLMoE's 4-bit fused experts (``target_parameters``), trained under checkpointing.

A neighbour's bug, shown beside this package: PEFT 0.21's ``ParamWrapper`` stacks a
``_LoraFactorsProxy`` on a single adapter's 3-D parameter, but ``_remove_parametrizations`` only
removes a ``_LoraParameterProxy``. On a parameter bitsandbytes already parametrizes (two
parametrizations, so PEFT does not remove the whole list) the LoRA proxy stays behind, PEFT warns
"Could not find any LoRA parametrization", and the next forward (the recompute of non-reentrant
checkpointing) calls ``requires_grad_(True)`` on the uint8 quantized weight. PEFT 0.20.0 has only the
one proxy, and trains.

    python tests/scenarios/peft_experts.py [--steps 3] [--layers 2] [--no-checkpointing]

PEFT comes from wherever ``import peft`` finds it (the tests put a release first on PYTHONPATH). One
JSON line per step (torch's counter, the loss), then a JSON summary: PEFT's version, whether
``bnb_gc_fix`` was imported, the error (type and first line) if training raised, and whether PEFT's
warning was emitted (its text, without the module's repr). A training error is reported, not raised:
the exit status is 0 whenever the scenario itself ran.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
import warnings
from pathlib import Path

import report
import tiny_olmoe

# The experts' fused 3-D parameters that tiny_olmoe quantizes (transformers 5's OlmoeExperts). A parameter
# bitsandbytes already parametrizes is matched by PEFT only under its full name (module name, dot, parameter):
# the short name, or a suffix, matches plain parameters only.
PARAMETERS = ("gate_up_proj", "down_proj")


def targets(layers: int) -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{name}" for i in range(layers) for name in PARAMETERS]


PEFT_WARNING = "Could not find any LoRA parametrization"


class _Captured(logging.Handler):
    """PEFT's log records, in case a release logs the warning instead of warnings.warn-ing it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _warning_text(message: str) -> str:
    """PEFT's warning with the ParamWrapper's multi-line repr (``on lora.ParamWrapper(...)``) cut out."""
    head, _, rest = message.partition(" on ")
    tail = rest.rsplit("), please", 1)
    return head + (", please" + tail[1] if len(tail) == 2 else "")


def _describe(error: BaseException) -> dict[str, object]:
    """The error's qualified type, its first line, and where it was raised: the innermost frame, as
    ``folder/file.py:function``."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    where = Path(frame.filename)
    return {
        "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
        "error": str(error).strip().splitlines()[0],
        "error_raised_in": f"{where.parent.name}/{where.name}:{frame.name}",
    }


def _stack(model) -> list[str]:  # type: ignore[no-untyped-def]
    """The parametrizations left on the first layer's ``gate_up_proj`` after training, by type name:
    bitsandbytes' own alone when PEFT cleaned up after itself."""
    for module in model.modules():
        parametrizations = getattr(module, "parametrizations", None)
        if parametrizations is not None and PARAMETERS[0] in parametrizations:
            return [type(p).__name__ for p in parametrizations[PARAMETERS[0]]]
    return []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true")
    args = parser.parse_args()

    import peft
    import torch
    from peft import LoraConfig, get_peft_model

    captured = _Captured()
    logging.getLogger("peft").addHandler(captured)
    summary: dict[str, object] = {"peft": peft.__version__, "error_type": None, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = tiny_olmoe.build(layers=args.layers, hidden=32, experts=4)
        if not args.no_checkpointing:
            tiny_olmoe.enable_checkpointing(model)
        model.config.use_cache = False
        config = LoraConfig(target_modules=[], target_parameters=targets(args.layers), r=4)
        model = get_peft_model(model, config)
        model.train()
        summary["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        for step in range(args.steps):
            record: dict[str, object] = {"step": step}
            phase = "forward"
            try:
                loss = model(input_ids=ids, labels=ids).loss
                phase = "backward"  # under checkpointing: the recompute
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            except Exception as error:  # the neighbour's error is the result
                summary.update(_describe(error), failed_step=step, failed_in=phase)
                report.emit(record | report.cache_state() | {"error": summary["error"]})
                break
            record["loss"] = float(loss.item())
            report.emit(record | report.cache_state())
    summary["stack"] = _stack(model)
    messages = [(type(w.message).__name__, str(w.message)) for w in caught]
    messages += [("logging", m) for m in captured.messages]
    peft_warnings = [(kind, m) for kind, m in messages if PEFT_WARNING in m]
    summary["peft_warning"] = bool(peft_warnings)
    summary["peft_warnings"] = len(peft_warnings)
    summary["peft_warning_category"] = peft_warnings[0][0] if peft_warnings else None
    summary["peft_warning_text"] = _warning_text(peft_warnings[0][1]) if peft_warnings else None
    summary["bnb_gc_fix_in_modules"] = "bnb_gc_fix" in sys.modules
    report.finish(summary)


if __name__ == "__main__":
    main()
