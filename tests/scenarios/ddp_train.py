"""DistributedDataParallel (gloo, CPU) around the tiny OLMoE with gradient checkpointing.

Launched by ``torchrun --nproc_per_node 2``; never imports bnb_gc_fix. Each rank writes one JSON
line per step and a summary line to ``$RESULTS_DIR/rank<N>.jsonl`` (the ranks share one stdout,
where their lines can interleave).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.utils.parametrize as P
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_olmoe import build, enable_checkpointing


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model, _ = build(layers=2)
    enable_checkpointing(model)
    model.config.use_cache = False
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(rank))
    steps = int(os.environ.get("STEPS", "3"))
    out = open(os.path.join(os.environ["RESULTS_DIR"], f"rank{rank}.jsonl"), "w")

    def write(record: dict[str, object]) -> None:
        print(json.dumps(record), file=out, flush=True)

    for step in range(steps):
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(
            json.dumps({"rank": rank, "step": step, "counter": int(P._cache_enabled)}), file=out, flush=True
        )
    fix = sys.modules.get("bnb_gc_fix")
    via = fix.status().asked_by if fix is not None else None
    print(
        json.dumps({"summary": {"rank": rank, "imported": fix is not None, "via": via}}), file=out, flush=True
    )
    out.close()
    # A clean shutdown: every rank is done before the group goes, and the interpreter's own
    # teardown is skipped. Left to it, gloo's threads can abort the process after its results are
    # written ("terminate called without an active exception"), about one run in four under load.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
