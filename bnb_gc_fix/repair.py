"""``repair(model)`` and ``reset()``: what a user calls by hand."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bnb_gc_fix import cache

if TYPE_CHECKING:
    import torch


def repair(model: torch.nn.Module) -> int:
    """Take over now, rather than at their next forward, the modules of ``model`` that hold a pair of
    hooks the fix is in; returns how many. Refuses (``RuntimeError``) while the counter holds holds the
    fix's hooks did not take: a forward started before the fix turned on may still be running."""
    from bnb_gc_fix import gate  # imports torch, which `model` needs anyway

    waiting = [m for m in model.modules() if gate.holds_a_pair(m) and not gate.is_taken_over(m)]
    others = cache.counter() - gate.held_by_every_thread()
    if waiting and others > 0:
        raise RuntimeError(
            f"bnb_gc_fix.repair: torch's parametrization cache holds {others} holds that bnb-gc-fix's hooks "
            "did not take (a forward of this model started before the fix turned on may still be running, "
            "or the counter is stuck): run repair() once nothing runs, after bnb_gc_fix.reset() if the "
            "counter is stuck. Nothing was changed."
        )
    for module in waiting:
        gate.take_over(module)
    return len(waiting)


def reset() -> int:
    """Release torch's parametrization cache, whoever holds it: the counter to 0, the cache emptied, the
    fix's holds forgotten. Returns how many holds there were. Never imports torch."""
    if cache.parametrize() is None:
        return 0
    from bnb_gc_fix import gate

    return int(gate.reset())
