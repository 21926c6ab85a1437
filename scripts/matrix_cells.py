"""The version matrix's cells, as data: one line a cell (scripts/matrix.py runs them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OLMOE = REPO / "tests" / "scenarios" / "tiny_olmoe.py"
LLAMA = REPO / "tests" / "scenarios" / "tiny_llama_linear.py"
WITH_STATUS = REPO / "scripts" / "scenarios" / "with_status.py"
SWITCH = "BNB_GC_FIX"
TF4_SPEC = "transformers==4.57.6"

# Expectation kinds.
NONE = "no-bitsandbytes"  # bitsandbytes not installed: import cleanly, say so
NO_PARAMETRIZE = "no-parametrize"  # < 0.48: nothing to do, status says why
AFFECTED = "affected"  # 0.48-0.49: patched, leak gone, control leaks
FIXED = "fixed-upstream"  # >= 0.50: steps aside, upstream's fix holds with and without us
NO_LEAK = "no-leak"  # reentrant checkpointing: nothing leaks even in the control

EXPECTATIONS = {
    NONE: "imports cleanly; status: bitsandbytes not installed, inactive; check exits 2",
    NO_PARAMETRIZE: "inactive, status says why; check exits 2",
    AFFECTED: "patched; fix: counter 0 every step; control leaks",
    FIXED: "steps aside (inactive, reason); counter 0 every step, unset and =0",
    NO_LEAK: "no leak in fix or control (reentrant checkpointing)",
}


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    bnb: str | None  # None: no bitsandbytes at all
    kind: str
    transformers: str = "installed"  # "installed" or "4.57"
    scenario: str = "olmoe"  # "olmoe" (fused 3-D experts) or "llama-linear" (2-D Linear weights)
    checkpointing: str = "non-reentrant"  # for llama-linear: non-reentrant | default
    note: str = ""


CELLS = [
    Cell("no-bnb", None, NONE, note="bitsandbytes not installed (venv without it)"),
    Cell("bnb-0.47.0", "0.47.0", NO_PARAMETRIZE, note="no bitsandbytes.nn.parametrize yet"),
    Cell("bnb-0.48.0", "0.48.0", AFFECTED),
    Cell("bnb-0.48.2", "0.48.2", AFFECTED),
    Cell("bnb-0.49.0", "0.49.0", AFFECTED),
    Cell("bnb-0.49.2", "0.49.2", AFFECTED),
    Cell("bnb-0.50.0", "0.50.0", FIXED, note="upstream fix (always_call)"),
    Cell("bnb-0.50.2", "0.50.2", FIXED, note="upstream fix (always_call)"),
    Cell(
        "bnb-0.49.2+tf4.57",
        "0.49.2",
        AFFECTED,
        transformers="4.57",
        scenario="llama-linear",
        note="2-D Linear weights, use_reentrant=False",
    ),
    Cell(
        "bnb-0.49.2+tf4.57-default",
        "0.49.2",
        NO_LEAK,
        transformers="4.57",
        scenario="llama-linear",
        checkpointing="default",
        note="2-D Linear weights, 4.57 default use_reentrant=True",
    ),
]
