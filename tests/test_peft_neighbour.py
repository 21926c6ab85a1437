"""A neighbour's bug that users will blame on this package: PEFT 0.21's LoRA on bitsandbytes-quantized fused
MoE experts (``target_parameters``) fails to train, with or without the fix.

PEFT 0.21's ``ParamWrapper`` stacks a ``_LoraFactorsProxy`` on a single adapter's 3-D parameter, but its
``_remove_parametrizations`` looks only for a ``_LoraParameterProxy``. On a parameter bitsandbytes already
parametrizes it finds none, warns "Could not find any LoRA parametrization" and leaves the proxy behind; the
next forward (the recompute, under non-reentrant checkpointing) then calls ``requires_grad_`` on the uint8
quantized weight: ``RuntimeError: only Tensors of floating point dtype can require gradients``. The failure
is the same with the fix and without it (BNB_GC_FIX=0), on bitsandbytes 0.50.2 (upstream's fix, where this
package steps aside) too, and without checkpointing at the second step: it is not this leak. PEFT 0.20.0
stacks only the one proxy and removes it: with the fix it trains, the counter 0 after every step, while its
control dies at the first recompute with torch's CheckpointError, the leak this package fixes.

Each test runs tests/scenarios/peft_experts.py (a tiny random OLMoE, 4-bit experts) in fresh interpreters,
with the fix and with its control beside it; PEFT comes from ``pip_target``, so the tests are `downloads`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    AFFECTED,
    BITSANDBYTES,
    FIX,
    SCENARIOS,
    TRANSFORMERS,
    Run,
    environment,
    pip_target,
    run_python,
)

pytestmark = [
    pytest.mark.downloads,
    pytest.mark.usefixtures("startup_hook_installed"),
    pytest.mark.skipif(
        BITSANDBYTES is None or TRANSFORMERS is None or int(TRANSFORMERS.split(".")[0]) < 5,
        reason="needs bitsandbytes and transformers 5 (fused 3-D experts)",
    ),
]

SCENARIO = SCENARIOS / "peft_experts.py"
PEFT_NEW = "0.21.2"  # the release with the bug (the newest when this was written)
PEFT_OLD = "0.20.0"  # the last release before it
BNB_UPSTREAM_FIXED = "0.50.2"

# The stable parts: the RuntimeError torch raises in PEFT's ParamWrapper._activate_lora, PEFT's warning
# (the ParamWrapper's repr cut out), and torch's CheckpointError, the leak's own symptom.
REQUIRES_GRAD = "only Tensors of floating point dtype can require gradients"
PEFT_WARNING = (
    "Could not find any LoRA parametrization, please open an issue on "
    "https://github.com/huggingface/peft/issues and report this warning."
)
CHECKPOINT_ERROR = (
    "torch.utils.checkpoint: A different number of tensors was saved during the original forward and "
    "recomputation."
)
# What each run's summary says that the switch does not change (the fix's own status fields aside).
SAME = (
    "peft",
    "error_type",
    "error",
    "error_raised_in",
    "failed_step",
    "failed_in",
    "stack",
    "peft_warnings",
)


@pytest.fixture(scope="module")
def peft_new() -> Path:
    return pip_target(f"peft=={PEFT_NEW}")


@pytest.fixture(scope="module")
def peft_old() -> Path:
    return pip_target(f"peft=={PEFT_OLD}")


def _scenario(folders: list[Path], switch: str | None, *flags: str) -> Run:
    env = environment(switch, PYTHONPATH=":".join(str(f) for f in folders))
    run = run_python(
        [str(SCENARIO), *flags], env=env, fresh="another PEFT (and bitsandbytes) first on PYTHONPATH"
    )
    assert run.returncode == 0, f"peft_experts failed:\n{run.stdout}\n{run.stderr}"
    return run


def _fix_and_control(folders: list[Path], *flags: str, switch: str | None = FIX) -> tuple[Run, Run]:
    return _scenario(folders, switch, *flags), _scenario(folders, "0", *flags)


def _assert_peft_021_failure(run: Run, step: int, phase: str) -> None:
    summary = run.summary
    assert summary["peft"] == PEFT_NEW
    assert (summary["error_type"], summary["error"]) == ("builtins.RuntimeError", REQUIRES_GRAD)
    assert summary["error_raised_in"] == "lora/layer.py:_activate_lora"
    assert (summary["failed_step"], summary["failed_in"]) == (step, phase)
    # PEFT warned (one per wrapped parameter: 2 layers x 2) and left its proxy on bitsandbytes' weight.
    assert summary["peft_warning_category"] == "UserWarning" and summary["peft_warning_text"] == PEFT_WARNING
    assert summary["peft_warnings"] == 4
    assert summary["stack"][0] == "Bnb4bitParametrization" and "_LoraFactorsProxy" in summary["stack"][1:]
    assert [s["counter"] for s in run.steps] == [0] * (step + 1)  # nothing leaked: the error came first


def test_peft_021_fails_the_same_with_and_without_the_fix(peft_new: Path) -> None:
    fixed, control = _fix_and_control([peft_new])
    _assert_peft_021_failure(fixed, step=0, phase="backward")
    _assert_peft_021_failure(control, step=0, phase="backward")
    assert {k: fixed.summary[k] for k in SAME} == {k: control.summary[k] for k in SAME}
    assert fixed.summary["bnb_gc_fix_in_modules"] is True and fixed.summary["asked_by"] is not None
    assert control.summary["bnb_gc_fix_in_modules"] is False


def test_peft_021_fails_the_same_on_upstream_fixed_bitsandbytes(peft_new: Path) -> None:
    """bitsandbytes 0.50.2 carries upstream's fix: the package steps aside; PEFT 0.21 fails all the same."""
    bnb = pip_target(f"bitsandbytes=={BNB_UPSTREAM_FIXED}")
    auto, control = _fix_and_control([peft_new, bnb], switch=None)
    _assert_peft_021_failure(auto, step=0, phase="backward")
    _assert_peft_021_failure(control, step=0, phase="backward")
    assert {k: auto.summary[k] for k in SAME} == {k: control.summary[k] for k in SAME}
    assert auto.summary["state"] == "not affected"


def test_peft_021_fails_without_checkpointing_at_the_second_step(peft_new: Path) -> None:
    """No recompute, no leak to fix: the left-behind proxy breaks the second step's forward instead."""
    fixed, control = _fix_and_control([peft_new], "--no-checkpointing")
    _assert_peft_021_failure(fixed, step=1, phase="forward")
    _assert_peft_021_failure(control, step=1, phase="forward")
    assert {k: fixed.summary[k] for k in SAME} == {k: control.summary[k] for k in SAME}


@pytest.mark.skipif(
    not AFFECTED, reason=f"the control leaks on an affected bitsandbytes only, not {BITSANDBYTES}"
)
def test_peft_020_trains_with_the_fix_and_its_control_hits_the_leak(peft_old: Path) -> None:
    fixed, control = _fix_and_control([peft_old])
    assert fixed.summary["peft"] == control.summary["peft"] == PEFT_OLD
    # With the fix: three steps, the counter 0 and the cache empty after each, the loss going down.
    assert fixed.summary["error"] is None and fixed.summary["peft_warning"] is False
    assert [(s["step"], s["counter"], s["cache_entries"]) for s in fixed.steps] == [
        (i, 0, 0) for i in range(3)
    ]
    losses = [s["loss"] for s in fixed.steps]
    assert losses == sorted(losses, reverse=True) and losses[0] > losses[-1]
    assert fixed.summary["stack"] == ["Bnb4bitParametrization"]  # PEFT 0.20.0 removed its proxy
    assert fixed.summary["state"] == "protected"
    # The control: the leak's own symptom at the first recompute, the cache left switched on.
    assert control.summary["error_type"] == "torch.utils.checkpoint.CheckpointError"
    assert control.summary["error"] == CHECKPOINT_ERROR
    assert (control.summary["failed_step"], control.summary["failed_in"]) == (0, "backward")
    assert control.summary["peft_warning"] is False and control.summary["bnb_gc_fix_in_modules"] is False
    [step] = control.steps
    assert step["counter"] > 0 and step["cache_entries"] > 0
