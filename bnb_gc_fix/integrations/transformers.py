"""Hugging Face: a ``TrainerCallback`` that puts a safety net around every training step.

Works with ``transformers.Trainer`` and TRL's trainers (importing ``bnb_gc_fix`` never imports this)::

    from bnb_gc_fix.integrations.transformers import LeakGuardCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[LeakGuardCallback()])
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from bnb_gc_fix.nets import Span


class LeakGuardCallback(TrainerCallback):
    """``bnb_gc_fix.guard()`` from ``on_step_begin`` to ``on_step_end``, its reports naming the step;
    ``strict=True`` stops the run with :class:`bnb_gc_fix.CacheLeakError` where holds stay."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.given_back = 0
        self._span: Span | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._span = Span.begin()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        span, self._span = self._span, None
        if span is None:
            return control
        ending = span.end()
        self.given_back += ending.given_back
        if not ending.clean:
            ending.tell("bnb_gc_fix", f"step {getattr(state, 'global_step', '?')}", self.strict)
        return control
