"""Memory benchmark: a tiny 4-bit OLMoE trained with gradient checkpointing in four fresh workers, driven in
lockstep: unfixed, this package, upstream 0.50's pairs, and the bug report's workaround (benchmarks/README.md,
"Memory").

    python benchmarks/memory.py                 # CPU, 50 steps: results/memory-cpu.md
    python benchmarks/memory.py --quick         # a smaller model and 10 steps (smoke run, results/tmp/)
    python benchmarks/memory.py --device cuda   # gpu.py runs this, after checking for a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import _harness as harness

CONFIGS = (harness.UNFIXED, harness.PACKAGE, harness.UPSTREAM, harness.WORKAROUND)
SIZES = {"layers": 6, "experts": 16, "hidden": 256, "batch": 2, "seq": 16, "steps": 50, "segment": 5}
QUICK = {"layers": 2, "experts": 8, "hidden": 128, "steps": 10, "segment": 2}
WORKER_OPTIONS = ("device", "dtype", "layers", "experts", "hidden", "batch", "seq")


def build_olmoe(args: argparse.Namespace) -> Any:
    """The tests' tiny OLMoE (``tests/scenarios/tiny_olmoe.py``): fused experts quantized to 4 bits, only
    the router gates trainable, built on the device before quantizing."""
    sys.path.insert(0, str(harness.ROOT / "tests" / "scenarios"))
    from tiny_olmoe import build

    model, _ = build(args.layers, args.experts, args.hidden, device=args.device, dtype=args.dtype)
    return model


def worker(args: argparse.Namespace) -> None:
    """Build the model as the configuration trains it, say it is ready, then run the driver's segments."""
    config = args.worker
    harness.start(config, threads=1)
    cuda = harness.is_cuda(args.device)
    model = build_olmoe(args)
    if config == harness.WORKAROUND:
        harness.checkpoint_experts_by_hand(model)  # and transformers' gradient checkpointing off
    else:
        model.gradient_checkpointing_enable()
    optimizer, ids = harness.trainer(model, 1e-3, args.batch, args.seq, args.device)
    experts = model.model.layers[0].mlp.experts
    hooks = [len(experts._forward_pre_hooks), len(experts._forward_hooks)]
    harness.emit({"fix": harness.fix_state(config), "hooks_on_one_experts_module": hooks})
    for line in sys.stdin:
        steps = json.loads(line)["steps"]
        records = [harness.train_step(model, ids, optimizer, cuda) for _ in range(steps)]
        harness.emit({"records": records})


def start_worker(config: str, args: argparse.Namespace) -> harness.Worker:
    options = {"worker": config, **{option: getattr(args, option) for option in WORKER_OPTIONS}}
    command = harness.worker_command(Path(__file__).resolve(), options)
    return harness.Worker(config, command, harness.config_env(config))


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Every worker runs a segment of steps a round, one worker at a time, the order alternating every
    round; returns what each said when ready and its per-step records."""
    workers = {config: start_worker(config, args) for config in CONFIGS}
    ready: dict[str, Any] = {}
    records: dict[str, list[dict[str, Any]]] = {config: [] for config in CONFIGS}
    try:
        for config, worker_ in workers.items():
            ready[config] = worker_.receive()
        rounds = range(0, args.steps, args.segment)
        for index, done in enumerate(rounds):
            steps = min(args.segment, args.steps - done)
            for config in harness.order_of(list(CONFIGS), index):
                workers[config].send({"steps": steps})
                records[config] += workers[config].receive()["records"]
            counters = [records[config][-1]["counter"] for config in CONFIGS]
            print(f"step {done + steps:3d}: counters {counters}", file=sys.stderr)
    finally:
        for worker_ in workers.values():
            worker_.close()
    return {"ready": ready, "records": records}


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's steps: the counter after steps 1, 2 and the last, the bytes the cache holds after
    the last; the step time and (on CUDA) the peak memory over the steps after the first (lazy
    initialisation), and the memory allocated after the last."""
    later = records[1:] or records
    found: dict[str, Any] = {
        "counter": [records[0]["counter"], records[1]["counter"], records[-1]["counter"]],
        "cache_bytes": records[-1]["cache_bytes"],
        "step_s": harness.Spread.of([record["step_s"] for record in later]).record(),
    }
    if "max_allocated_bytes" in records[-1]:
        found["peak_bytes"] = harness.Spread.of([record["max_allocated_bytes"] for record in later]).record()
        found["allocated_bytes"] = records[-1]["allocated_bytes"]
    return found


NOT_MEASURED = "not measured"


def row(config: str, found: dict[str, Any] | None, cuda: bool) -> list[str]:
    """A configuration's row; a configuration with no figures says so in every cell."""
    columns = 6 if cuda else 4
    if found is None:
        return [config, *[NOT_MEASURED] * (columns - 1)]
    counters = " / ".join(str(counter) for counter in found["counter"])
    held = f"{found['cache_bytes']:,} ({harness.mib(found['cache_bytes'])})"
    step = harness.Spread(**found["step_s"]).text(" ms", 0, scale=1e-3)
    cells = [config, counters, held, step]
    if cuda:
        cells.append(harness.mib(found["allocated_bytes"]))
        cells.append(harness.Spread(**found["peak_bytes"]).text(" MiB", 1, scale=2**20))
    return cells


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    cuda = harness.is_cuda(settings["device"])
    last = settings["steps"]
    header = [
        "configuration",
        f"counter after steps 1 / 2 / {last}",
        f"bytes held by the cache after step {last}",
    ]
    header.append("step time, median (IQR)")
    if cuda:
        header += [f"allocated after step {last}", "peak allocated per step, median (IQR)"]
    rows = [row(config, result["configs"].get(config), cuda) for config in CONFIGS]
    model = f"{settings['layers']} layers, {settings['experts']} experts, hidden {settings['hidden']}"
    lines = [
        f"Tiny OLMoE: {model}, {settings['dtype']}, batch {settings['batch']}x{settings['seq']}, {last} "
        f"steps on {settings['device']}, in segments of {settings['segment']} steps, the workers' order "
        "alternating every round. Step time (and on CUDA the peak) over steps 2 onwards.",
        "",
        *harness.table(header, rows),
        "",
        f"Losses identical in every configuration measured, at every step: {result['losses_identical']}.",
        "",
        harness.machine_line(result["machine"]),
    ]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float32")
    for name, default in SIZES.items():
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="2 layers, 8 experts, hidden 128, 10 steps")
    parser.add_argument("--output", type=Path, help="the raw JSON (its .md beside it)")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return None
    machine = harness.machine()
    run = drive(args)
    records = run["records"]
    losses = [[record["loss"] for record in records[config]] for config in CONFIGS]
    result = {
        "benchmark": "memory",
        "machine": machine,
        "settings": {name: getattr(args, name) for name in ("device", "dtype", *SIZES)},
        "ready": run["ready"],
        "configs": {config: summary(records[config]) for config in CONFIGS},
        "losses_identical": all(found == losses[0] for found in losses),
        "records": records,
    }
    name = f"memory-{'cuda' if harness.is_cuda(args.device) else 'cpu'}{'-quick' if args.quick else ''}"
    harness.write_results(name, result, markdown(result), args.quick, args.output)
    return result


if __name__ == "__main__":
    main()
