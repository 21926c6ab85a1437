"""Hugging Face integration: a ``TrainerCallback`` that runs the leak guard at every step end.

Works with ``transformers.Trainer`` and with TRL's trainers, which accept the same callbacks::

    from bnb_gc_fix.integrations.transformers import LeakGuardCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[LeakGuardCallback()])

Importing ``bnb_gc_fix`` never imports this module (nor transformers).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from bnb_gc_fix.guard import check_and_release, counter_now


class LeakGuardCallback(TrainerCallback):
    """Release what a training step left switched on in the parametrization cache, at its end.

    Only holds the step added (the counter at ``on_step_begin`` against ``on_step_end``) and that
    no running call owns are released. With ``strict=True`` a stuck cache raises
    :class:`bnb_gc_fix.CacheLeakError` (after releasing), stopping the run; otherwise one
    :class:`bnb_gc_fix.CacheLeakWarning` per step that needed it. ``released`` counts the holds
    released over the run.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.released = 0
        self._start = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._start = counter_now()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.released += check_and_release(strict=self.strict, start=self._start)
        return control
