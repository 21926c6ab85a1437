"""Memory benchmark: a tiny 4-bit OLMoE trained with gradient checkpointing, unfixed vs this package vs
upstream 0.50's fix, three workers driven in lockstep (benchmarks/README.md, "Memory").

    python benchmarks/memory.py                 # CPU, 50 steps, results/memory-cpu.json + .md
    python benchmarks/memory.py --quick         # a smaller model and 10 steps (smoke run)
    python benchmarks/memory.py --device cuda   # see gpu.py, which wraps this for CUDA
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import _common as common
import _harness as harness

#: The model and the protocol, each an option of the same name; the worker gets the model's.
SIZES = {"layers": 6, "experts": 16, "hidden": 256, "batch": 2, "seq": 16, "threads": 1}
PROTOCOL = {"steps": 50, "segment": 5, "extra_rounds": 10}
QUICK = {"layers": 2, "experts": 8, "hidden": 128, "steps": 10, "segment": 2, "extra_rounds": 2}
WORKER_OPTIONS = ("device", "dtype", *SIZES)


def worker(args: argparse.Namespace) -> None:
    """Build the model, say it is ready, then run the driver's segments of steps."""
    config = args.worker
    common.start(config, args.threads)
    import torch

    cuda = harness.is_cuda(args.device)
    started = time.perf_counter()
    model = common.build_olmoe(args.layers, args.experts, args.hidden, device=args.device, dtype=args.dtype)
    model.gradient_checkpointing_enable()
    optimizer, ids, trainable = common.trainer(model, 1e-3, args.batch, args.seq, args.device)
    experts = model.model.layers[0].mlp.experts
    if cuda:
        torch.cuda.synchronize()
    harness.emit(
        {
            "ready": config,
            "build_s": time.perf_counter() - started,
            "fix": common.fix_state(config),
            "hooks_on_one_experts_module": {
                "pre": len(experts._forward_pre_hooks),
                "post": len(experts._forward_hooks),
            },
            "quantized_parameters": 2 * len(model.model.layers),
            "trainable_parameters": sum(parameter.numel() for parameter in trainable),
            "rss_after_build": common.proc_status().get("VmRSS"),
            "allocated_after_build": torch.cuda.memory_allocated() if cuda else None,
        }
    )
    step = 0
    for command in harness.commands():
        if command["cmd"] == "quit":
            break
        segment_started = time.perf_counter()
        for _ in range(command["steps"]):
            harness.emit({"record": common.train_step(model, ids, optimizer, step, cuda)})
            step += 1
        harness.emit({"segment_s": time.perf_counter() - segment_started})


def start_worker(config: str, args: argparse.Namespace) -> harness.Worker:
    options = {"worker": config, **{name: getattr(args, name) for name in WORKER_OPTIONS}}
    command = harness.worker_command(Path(__file__).resolve(), options)
    return harness.Worker(config, command, common.config_env(config))


def run_segment(worker_: harness.Worker, steps: int, records: list[dict[str, Any]]) -> float:
    """``steps`` steps of one worker; its records go to ``records``; returns the segment's time."""
    worker_.send({"cmd": "run", "steps": steps})
    while True:
        message = worker_.receive()
        if "record" not in message:
            return float(message["segment_s"])
        records.append(message["record"])


def timed_round(
    workers: dict[str, harness.Worker], records: dict[str, list[dict[str, Any]]], index: int, steps: int
) -> dict[str, Any]:
    """One round: every worker in ``workers`` runs ``steps`` steps, in an order alternating by round."""
    order = harness.order_of(list(workers), index)
    times = {config: run_segment(workers[config], steps, records[config]) for config in order}
    return {"round": index, "steps": steps, "order": order, "segment_s": times}


def drive(args: argparse.Namespace) -> dict[str, Any]:
    workers = {config: start_worker(config, args) for config in common.CONFIGS}
    ready: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {config: [] for config in common.CONFIGS}
    rounds: list[dict[str, Any]] = []
    try:
        for config, worker_ in workers.items():
            ready[config] = worker_.receive()
            print(f"{config}: built in {ready[config]['build_s']:.1f} s", file=sys.stderr)
        done = 0
        while done < args.steps:
            steps = min(args.segment, args.steps - done)
            rounds.append(timed_round(workers, records, len(rounds), steps))
            done += steps
            _progress(done, records)
        # Timing-only rounds of the two fixed configurations, still alternating: their steps are not
        # part of the memory figures (those are the first --steps steps of every worker).
        fixed = {config: workers[config] for config in (common.PACKAGE, common.UPSTREAM)}
        for _ in range(args.extra_rounds):
            rounds.append(timed_round(fixed, records, len(rounds), args.segment))
        print(f"{args.extra_rounds} timing-only rounds done", file=sys.stderr)
    finally:
        for worker_ in workers.values():
            worker_.close()
    return summarise(args, ready, records, rounds)


def _progress(done: int, records: dict[str, list[dict[str, Any]]]) -> None:
    states = [
        f"{config}: counter {found[-1]['counter']:4d} cache {harness.mib(found[-1]['cache_bytes'])}"
        for config, found in records.items()
    ]
    print(f"step {done:3d}  " + "  ".join(states), file=sys.stderr)


def final_state(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a configuration's memory steps left: the last step's cache and memory, the median step."""
    last = records[-1]
    final: dict[str, Any] = {
        "steps": len(records),
        "counter": last["counter"],
        "cache_entries": last["cache_entries"],
        "cache_bytes": last["cache_bytes"],
        "max_cache_bytes_after_a_step": max(record["cache_bytes"] for record in records),
        "median_step_s": harness.median([record["step_s"] for record in records]),
        "rss_bytes": last["rss_bytes"],
    }
    if "allocated_bytes" in last:
        final["allocated_bytes"] = last["allocated_bytes"]
        final["max_allocated_bytes"] = max(record["max_allocated_bytes"] for record in records)
        final["allocated_growth_bytes"] = last["allocated_bytes"] - records[0]["allocated_bytes"]
    return final


def summarise(
    args: argparse.Namespace,
    ready: dict[str, dict[str, Any]],
    records: dict[str, list[dict[str, Any]]],
    rounds: list[dict[str, Any]],
) -> dict[str, Any]:
    memory_steps = {config: found[: args.steps] for config, found in records.items()}
    configs = {
        config: {
            "description": common.DESCRIPTIONS[config],
            "env_BNB_GC_FIX": common.config_env(config).get("BNB_GC_FIX"),
            **ready[config],
            "final": final_state(steps),
            "steps": steps,
        }
        for config, steps in memory_steps.items()
    }
    # The first round holds each worker's first step (lazy initialisation): left out.
    timed = rounds[1:] if len(rounds) > 1 else rounds
    per_round = [r["segment_s"][common.PACKAGE] / r["segment_s"][common.UPSTREAM] for r in timed]
    ratio = harness.Spread.of(per_round)
    with_unfixed = [r for r in timed if common.UNFIXED in r["order"]]
    unfixed_ratios = [r["segment_s"][common.PACKAGE] / r["segment_s"][common.UNFIXED] for r in with_unfixed]
    losses = [[record["loss"] for record in steps] for steps in memory_steps.values()]
    return {
        "benchmark": "memory",
        "device": args.device,
        "machine": harness.machine(),
        "settings": {
            **{name: getattr(args, name) for name in ("layers", "experts", "hidden", "batch", "seq")},
            "dtype": args.dtype,
            "steps": args.steps,
            "segment_steps": args.segment,
            "torch_threads_per_worker": args.threads,
            "gradient_checkpointing": "transformers default (non-reentrant)",
            "trainable": "router gates (.mlp.gate.) only, AdamW",
        },
        "configs": configs,
        "timing": {
            "method": (
                "workers run segments of steps one at a time, order alternating every round; "
                "ratio = median over rounds of segment time bnb-gc-fix / upstream-0.50; the first round "
                "(first steps, lazy initialisation) is left out; extra timing-only rounds alternate the "
                "two fixed configurations after the memory steps"
            ),
            "extra_rounds": args.extra_rounds,
            "rounds": rounds,
            "ratio_package_over_upstream": {**ratio.record(), "per_round": per_round},
            "result": harness.verdict(ratio, floor=None),
            "ratio_package_over_unfixed": {"median": harness.median(unfixed_ratios)},
        },
        "losses_identical": all(found == losses[0] for found in losses),
        "notes": notes(args.device),
    }


def notes(device: str) -> list[str]:
    found = [
        "cache_bytes: bytes held by the tensors in torch's parametrization cache after each step, "
        "i.e. dequantized copies of 4-bit weights that nothing will free.",
        "unfixed steps are faster only because its cache is never emptied: it dequantizes each "
        "expert weight once and reuses that copy for ever (stale if the quantized data changed).",
    ]
    if not harness.is_cuda(device):
        found.append(
            "CPU: process RSS is dominated by the allocator (freed memory is not returned to the OS) "
            "and by the model build, so it is recorded but not a fair measure of the leak; the "
            "honest CPU figure is cache_bytes."
        )
    return found


def _row(config: str, final: dict[str, Any], cuda: bool) -> list[str]:
    row = [
        config,
        str(final["counter"]),
        str(final["cache_entries"]),
        f"{final['cache_bytes']:,} ({harness.mib(final['cache_bytes'])})",
        f"{final['median_step_s'] * 1e3:.0f} ms",
    ]
    if cuda:
        row += [harness.mib(final["allocated_bytes"]), harness.mib(final["max_allocated_bytes"])]
    return row


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    cuda = harness.is_cuda(result["device"])
    shape = f"{settings['layers']} layers, {settings['experts']} experts, hidden {settings['hidden']}"
    header = ["configuration", "counter after last step", "cache entries", "cache bytes retained"]
    header.append("median step")
    if cuda:
        header += ["allocated after last step", "peak allocated"]
    rows = [_row(config, result["configs"][config]["final"], cuda) for config in common.CONFIGS]
    per_round = result["timing"]["ratio_package_over_upstream"]["per_round"]
    ratio = harness.Spread.of(per_round)
    lines = [
        f"Tiny OLMoE, {shape}, {settings['dtype']}, batch {settings['batch']}x{settings['seq']}, "
        f"gradient checkpointing, {settings['steps']} steps on {result['device']}.",
        "",
        *harness.table(header, rows),
        "",
        f"Step time bnb-gc-fix / upstream-0.50: **{result['timing']['result']}** (median {ratio.text()} "
        f"over {len(per_round)} alternating rounds of {settings['segment_steps']} steps, "
        f"range {ratio.min:.3f}-{ratio.max:.3f}).",
        f"Losses identical in all three configurations: {result['losses_identical']}.",
        "",
        *(f"- {note}" for note in result["notes"]),
    ]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float32")
    for name, default in {**SIZES, **PROTOCOL}.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--quick", action="store_true", help="2 layers, 8 experts, hidden 128, 10 steps")
    parser.add_argument("--output", type=Path, help="result JSON (default results/memory-<device>.json)")
    parser.add_argument("--worker", choices=common.CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return None
    started = time.perf_counter()
    result = drive(args)
    result["wall_s"] = time.perf_counter() - started
    kind = "cuda" if harness.is_cuda(args.device) else "cpu"
    name = f"memory-{kind}{'-quick' if args.quick else ''}.json"
    output = harness.output_path(name, args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
