"""What the training scenarios print: torch's cache state after a step, and a closing summary.

Shared by ``tiny_olmoe.py`` and ``tiny_llama_linear.py`` so that
every scenario reports the same fields the same way, one JSON object per line.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def cache_state() -> dict[str, int]:
    """torch's parametrization cache now: the counter, its entries, the bytes its tensors hold."""
    import torch.nn.utils.parametrize as P

    return {
        "counter": int(P._cache_enabled),
        "cache_entries": len(P._cache),
        "cache_bytes": sum(t.numel() * t.element_size() for t in P._cache.values()),
    }


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def finish(summary: dict[str, Any]) -> None:
    """Print the summary line, with bnb_gc_fix's status if something imported the package: its state and
    reason, who asked for the fix (``asked_by``), and whether it went into a library's hooks (``fixed``)."""
    fix = sys.modules.get("bnb_gc_fix")
    summary["bnb_gc_fix_imported"] = fix is not None
    if fix is not None:
        status = fix.status()
        summary.update(state=status.state, reason=status.reason, asked_by=status.asked_by, fixed=status.fixed)
    emit({"summary": summary})
