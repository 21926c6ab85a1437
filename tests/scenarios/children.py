"""A parent that never imports bnb_gc_fix starts a multiprocessing spawn child and a subprocess
child; each trains the tiny OLMoE with checkpointing for 2 steps. Prints one JSON object."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def train(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    sys.path.insert(0, HERE)
    import torch.nn.utils.parametrize as P
    from tiny_olmoe import build

    model, _ = build(layers=2)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    counters = []
    ids = __import__("torch").randint(0, 128, (1, 16))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        counters.append(int(P._cache_enabled))
    fix = sys.modules.get("bnb_gc_fix")
    queue.put({"counters": counters, "via": fix.status().asked_by if fix else None})


def main() -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=train, args=(queue,))
    child.start()
    spawned = queue.get(timeout=600)
    child.join()
    output = subprocess.run(
        [sys.executable, os.path.join(HERE, "tiny_olmoe.py"), "--steps", "2", "--layers", "2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    sub = {
        "counters": [r["counter"] for r in lines if "step" in r],
        "via": next(r["summary"] for r in lines if "summary" in r).get("asked_by"),
    }
    print(json.dumps({"parent_imported": "bnb_gc_fix" in sys.modules, "spawn": spawned, "subprocess": sub}))


if __name__ == "__main__":
    main()
