"""Hugging Face integration: a ``TrainerCallback`` that runs the leak guard at every step end.

Works with ``transformers.Trainer`` and TRL's trainers (importing ``bnb_gc_fix`` never imports this)::

    from bnb_gc_fix.integrations.transformers import LeakGuardCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[LeakGuardCallback()])
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from _bnb_gc_fix import cache
from bnb_gc_fix.guard import check_and_release


class LeakGuardCallback(TrainerCallback):
    """Run :func:`bnb_gc_fix.guard.check_and_release` at each step's end (``strict=True``: a
    :class:`bnb_gc_fix.CacheLeakError` stops the run); ``released`` counts the holds released."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.released = 0
        self._start = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._start = cache.counter()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        where = f"step {getattr(state, 'global_step', '?')}"
        self.released += check_and_release(strict=self.strict, start=self._start, where=where)
        return control
