"""Memory benchmark: a tiny 4-bit OLMoE trained with gradient checkpointing, unfixed vs this package vs
upstream 0.50's fix, and a second upstream worker as the step time's noise floor, all driven in lockstep
(benchmarks/README.md, "Memory").

    python benchmarks/memory.py                 # CPU, 50 steps, results/memory-cpu.json + .md
    python benchmarks/memory.py --quick         # a smaller model and 10 steps (smoke run, results/tmp/)
    python benchmarks/memory.py --device cuda   # see gpu.py, which wraps this for CUDA
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import _harness as harness

#: The model and the protocol, each an option of the same name; the worker gets the model's.
SIZES = {"layers": 6, "experts": 16, "hidden": 256, "batch": 2, "seq": 16, "threads": 1}
PROTOCOL = {"steps": 50, "segment": 5, "extra_rounds": 10}
QUICK = {"layers": 2, "experts": 8, "hidden": 128, "steps": 10, "segment": 2, "extra_rounds": 2}
WORKER_OPTIONS = ("device", "dtype", *SIZES)
#: The workers, each running a configuration; the floor's steps are timed only, never reported.
FLOOR = "upstream-0.50, a second worker (noise floor)"
WORKERS = {**{config: config for config in harness.CONFIGS}, FLOOR: harness.UPSTREAM}
FIXED = (harness.PACKAGE, harness.UPSTREAM, FLOOR)  # the workers of the timing-only rounds


def build_olmoe(layers: int, experts: int, hidden: int, device: str, dtype: str) -> Any:
    """The tests' tiny OLMoE (``tests/scenarios/tiny_olmoe.py``): fused experts quantized to 4 bits,
    only the router gates trainable, built on ``device`` before quantizing."""
    sys.path.insert(0, str(harness.ROOT / "tests" / "scenarios"))
    from tiny_olmoe import build

    model, _ = build(layers=layers, experts=experts, hidden=hidden, device=device, dtype=dtype)
    return model


def worker(args: argparse.Namespace) -> None:
    """Build the model, say it is ready, then run the driver's segments of steps."""
    config = args.worker
    harness.start(config, args.threads)
    import torch

    cuda = harness.is_cuda(args.device)
    started = time.perf_counter()
    model = build_olmoe(args.layers, args.experts, args.hidden, device=args.device, dtype=args.dtype)
    model.gradient_checkpointing_enable()
    optimizer, ids, trainable = harness.trainer(model, 1e-3, args.batch, args.seq, args.device)
    experts = model.model.layers[0].mlp.experts
    if cuda:
        torch.cuda.synchronize()
    harness.emit(
        {
            "ready": config,
            "build_s": time.perf_counter() - started,
            "fix": harness.fix_state(config),
            "hooks_on_one_experts_module": {
                "pre": len(experts._forward_pre_hooks),
                "post": len(experts._forward_hooks),
            },
            "quantized_parameters": 2 * len(model.model.layers),
            "trainable_parameters": sum(parameter.numel() for parameter in trainable),
            "rss_after_build": harness.proc_status().get("VmRSS"),
            "allocated_after_build": torch.cuda.memory_allocated() if cuda else None,
        }
    )
    step = 0
    for command in harness.commands():
        if command["cmd"] == "quit":
            break
        segment_started = time.perf_counter()
        for _ in range(command["steps"]):
            harness.emit({"record": harness.train_step(model, ids, optimizer, step, cuda)})
            step += 1
        harness.emit({"segment_s": time.perf_counter() - segment_started})


def start_worker(name: str, args: argparse.Namespace) -> harness.Worker:
    config = WORKERS[name]
    options = {"worker": config, **{option: getattr(args, option) for option in WORKER_OPTIONS}}
    command = harness.worker_command(Path(__file__).resolve(), options)
    return harness.Worker(name, command, harness.config_env(config))


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
    workers = {name: start_worker(name, args) for name in WORKERS}
    ready: dict[str, dict[str, Any]] = {}
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in WORKERS}
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
        # Timing-only rounds of the fixed workers, still alternating: their steps are not part of the
        # memory figures (those are the first --steps steps of every worker).
        fixed = {name: workers[name] for name in FIXED}
        for _ in range(args.extra_rounds):
            rounds.append(timed_round(fixed, records, len(rounds), args.segment))
        print(f"{args.extra_rounds} timing-only rounds done", file=sys.stderr)
    finally:
        for worker_ in workers.values():
            worker_.close()
    return summarise(args, ready, records, rounds)


def _progress(done: int, records: dict[str, list[dict[str, Any]]]) -> None:
    states = [
        f"{config}: counter {records[config][-1]['counter']:4d} "
        f"cache {harness.mib(records[config][-1]['cache_bytes'])}"
        for config in harness.CONFIGS
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
    memory_steps = {config: records[config][: args.steps] for config in harness.CONFIGS}
    configs = {
        config: {
            "description": harness.DESCRIPTIONS[config],
            "env_BNB_GC_FIX": harness.config_env(config).get("BNB_GC_FIX"),
            **ready[config],
            "final": final_state(steps),
            "steps": steps,
        }
        for config, steps in memory_steps.items()
    }
    # The first round holds each worker's first step (lazy initialisation): left out.
    timed = rounds[1:] if len(rounds) > 1 else rounds
    segments = {name: [r["segment_s"][name] for r in timed] for name in FIXED}
    comparison = harness.compare(segments[harness.PACKAGE], segments[harness.UPSTREAM], segments[FLOOR])
    with_unfixed = [r for r in timed if harness.UNFIXED in r["order"]]
    over_unfixed = [r["segment_s"][harness.PACKAGE] / r["segment_s"][harness.UNFIXED] for r in with_unfixed]
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
                "workers run segments of steps one at a time, order alternating every round; ratio = "
                "median over rounds of segment time / upstream-0.50's in the same round, with the "
                "interquartile range; noise floor: a second upstream-0.50 worker in the same rounds; the "
                "first round (first steps, lazy initialisation) is left out; extra timing-only rounds "
                "alternate the fixed workers after the memory steps"
            ),
            "extra_rounds": args.extra_rounds,
            "rounds": rounds,
            "package_over_upstream": comparison,
            "package_over_unfixed": harness.Spread.of(over_unfixed).record(),
            "rounds_with_unfixed": len(over_unfixed),
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
    rows = [_row(config, result["configs"][config]["final"], cuda) for config in harness.CONFIGS]
    timing = result["timing"]
    comparison = timing["package_over_upstream"]
    ratio = harness.Spread(**comparison["ratio"])
    floor = harness.Spread(**comparison["noise_floor"])
    over_unfixed = harness.Spread(**timing["package_over_unfixed"])
    lines = [
        f"Tiny OLMoE, {shape}, {settings['dtype']}, batch {settings['batch']}x{settings['seq']}, "
        f"gradient checkpointing, {settings['steps']} steps on {result['device']}.",
        "",
        *harness.table(header, rows),
        "",
        f"Step time bnb-gc-fix / upstream-0.50: **{comparison['result']}** ({ratio.text()}; noise floor, "
        f"a second upstream-0.50 worker: {floor.text()}; {len(timing['rounds']) - 1} alternating rounds of "
        f"{settings['segment_steps']} steps, the first left out). bnb-gc-fix / unfixed: "
        f"{over_unfixed.text()} over the {timing['rounds_with_unfixed']} rounds with the unfixed worker.",
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
    parser.add_argument("--worker", choices=harness.CONFIGS, help=argparse.SUPPRESS)
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
