"""A real ``transformers.Trainer`` run (CPU, gradient checkpointing, 4 steps) on the tiny OLMoE
with quantized experts, with or without ``LeakGuardCallback``. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import warnings

import torch
import torch.nn.utils.parametrize as P
from transformers import Trainer, TrainerCallback, TrainingArguments

import bnb_gc_fix

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tiny_olmoe import CHECKPOINTING, build


class Recorder(TrainerCallback):
    """Runs after the guard: records the counter at every step end, and how many Python threads run then."""

    def __init__(self) -> None:
        self.counters: list[int] = []
        self.threads: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.counters.append(int(P._cache_enabled))
        self.threads.append(threading.active_count())


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--callback", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    model, _ = build(layers=2)
    model.config.use_cache = False
    guard = None
    callbacks: list[TrainerCallback] = []
    if args.callback:
        from bnb_gc_fix.integrations.transformers import LeakGuardCallback

        guard = LeakGuardCallback()
        callbacks.append(guard)
    recorder = Recorder()
    callbacks.append(recorder)
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks).train()
    print(
        json.dumps(
            {
                "steps": len(recorder.counters),
                "counters": recorder.counters,
                "threads": recorder.threads,
                "reports": [str(w.message) for w in caught if str(w.message).startswith("bnb_gc_fix")],
                "given_back": guard.given_back if guard else None,
                "state": bnb_gc_fix.status().state,
            }
        )
    )


if __name__ == "__main__":
    main()
