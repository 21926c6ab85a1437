"""A real ``transformers.Trainer`` run (CPU, gradient checkpointing, 4 steps) on the tiny OLMoE with
quantized experts, as a user's script runs it: the package is never imported by it. Prints one JSON
object: the counter at every step's end, the state, and whether the fix went into bitsandbytes' hooks
(None for both where the package was never imported)."""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.nn.utils.parametrize as P
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tiny_olmoe import CHECKPOINTING, build


class Recorder(TrainerCallback):
    """Records the counter at every step's end."""

    def __init__(self) -> None:
        self.counters: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.counters.append(int(P._cache_enabled))


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    model, _ = build(layers=2)
    model.config.use_cache = False
    recorder = Recorder()
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs=CHECKPOINTING,
            max_steps=4,
            per_device_train_batch_size=1,
            learning_rate=1e-2,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=[recorder]).train()
    fix = sys.modules.get("bnb_gc_fix")
    status = None if fix is None else fix.status()
    state, fixed = (None, None) if status is None else (status.state, status.fixed)
    print(json.dumps({"counters": recorder.counters, "state": state, "fixed": fixed}))


if __name__ == "__main__":
    main()
