"""Memory benchmark: a tiny 4-bit OLMoE trained with gradient checkpointing, three ways.

Each configuration runs in its own fresh interpreter (a worker), started side by side:

* ``unfixed``        bitsandbytes as installed, ``BNB_GC_FIX=0``;
* ``bnb-gc-fix``     bitsandbytes as installed, ``import bnb_gc_fix``;
* ``upstream-0.50``  bitsandbytes as installed, ``BNB_GC_FIX=0``, and upstream 0.50's hooks
  (``always_call=True`` disable hook, counter clamped at zero) patched in by the benchmark,
  so that the package is compared with upstream's fix on the same bitsandbytes.

The workers build the model, then the driver makes them train in lockstep: short segments
of steps, one worker at a time, the order alternating every round. Every step records the
parametrization-cache counter (``torch.nn.utils.parametrize._cache_enabled``), the bytes held
by the tensors in its cache, the step time, and on CUDA ``memory_allocated`` and
``max_memory_allocated``. The step-time ratio bnb-gc-fix / upstream is the median over rounds
of the ratio of the two segments of the round (both workers ran the same steps back to back).

    python benchmarks/memory.py                 # CPU, 50 steps, results/memory-cpu.json + .md
    python benchmarks/memory.py --quick         # a smaller model and 10 steps (smoke run)
    python benchmarks/memory.py --device cuda   # see gpu.py, which wraps this for CUDA
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import _common as common
import _harness as harness
from _harness import emit

#: The worker's options, passed on by the driver.
WORKER_OPTIONS = ("device", "dtype", "layers", "experts", "hidden", "batch", "seq", "threads")

# --------------------------------------------------------------------------- the worker


def _fix_state(config: str) -> dict[str, Any]:
    """Evidence that the worker runs the configuration it claims to run."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    state: dict[str, Any] = {
        "bnb_gc_fix_imported": "bnb_gc_fix" in sys.modules,
        "register_hooks": type(bnb_parametrize._register_parametrization_hooks).__name__,
    }
    if "bnb_gc_fix" in sys.modules:
        status = sys.modules["bnb_gc_fix"].status()
        state["active"] = status.active
        state["reason"] = status.reason
    if config == common.PACKAGE and not state.get("active"):
        raise SystemExit(f"bnb-gc-fix is not active in the {config} worker: {state}")
    if config != common.PACKAGE and state["bnb_gc_fix_imported"]:
        raise SystemExit(f"bnb_gc_fix was imported in the {config} worker (is BNB_GC_FIX=0 set?)")
    return state


def worker(args: argparse.Namespace) -> None:
    config = args.worker
    if config == common.PACKAGE:
        import bnb_gc_fix  # noqa: F401  (the import activates the fix)
    import torch

    torch.set_num_threads(args.threads)
    if config == common.UPSTREAM:
        common.apply_upstream_fix()
    device = args.device
    cuda = device.startswith("cuda")

    started = time.perf_counter()
    model = common.build_olmoe(args.layers, args.experts, args.hidden, device=device, dtype=args.dtype)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (args.batch, args.seq), generator=generator).to(device)
    experts = model.model.layers[0].mlp.experts
    hooks = {"pre": len(experts._forward_pre_hooks), "post": len(experts._forward_hooks)}
    if cuda:
        torch.cuda.synchronize()
    emit(
        {
            "ready": config,
            "build_s": time.perf_counter() - started,
            "fix": _fix_state(config),
            "hooks_on_one_experts_module": hooks,
            "quantized_parameters": sum(2 for _ in model.model.layers),
            "trainable_parameters": sum(parameter.numel() for parameter in trainable),
            "rss_after_build": common.rss_bytes(),
            "allocated_after_build": torch.cuda.memory_allocated() if cuda else None,
        }
    )

    step = 0
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        segment_started = time.perf_counter()
        for _ in range(command["steps"]):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            counter, entries, cached = common.cache_state()
            record: dict[str, Any] = {
                "step": step,
                "step_s": elapsed,
                "loss": float(loss.item()),
                "counter": counter,
                "cache_entries": entries,
                "cache_bytes": cached,
                "rss_bytes": common.rss_bytes(),
            }
            if cuda:
                record["allocated_bytes"] = torch.cuda.memory_allocated()
                record["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            emit({"record": record})
            step += 1
        emit({"segment_s": time.perf_counter() - segment_started})


# --------------------------------------------------------------------------- the driver


class Worker:
    """One configuration in its own interpreter, driven over its stdin/stdout."""

    def __init__(self, config: str, args: argparse.Namespace) -> None:
        self.config = config
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", config]
        for option in WORKER_OPTIONS:
            command += [f"--{option}", str(getattr(args, option))]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=common.config_env(config),
            cwd=harness.ROOT,
        )
        self.ready: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []

    def _read(self) -> dict[str, Any]:
        stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        for line in stdout:
            message = harness.message_of(line)
            if message is not None:
                return message
        code = self.process.wait()
        raise SystemExit(f"the {self.config} worker exited with status {code} (its stderr is above)")

    def _send(self, command: dict[str, Any]) -> None:
        stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    def wait_ready(self) -> None:
        self.ready = self._read()

    def run(self, steps: int) -> float:
        self._send({"cmd": "run", "steps": steps})
        while True:
            message = self._read()
            if "record" in message:
                self.records.append(message["record"])
            else:
                return float(message["segment_s"])

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._send({"cmd": "quit"})
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


def drive(args: argparse.Namespace) -> dict[str, Any]:
    workers = {config: Worker(config, args) for config in common.CONFIGS}
    try:
        for worker_ in workers.values():
            worker_.wait_ready()
            print(f"{worker_.config}: built in {worker_.ready['build_s']:.1f} s", file=sys.stderr)
        rounds: list[dict[str, Any]] = []
        done = 0
        index = 0
        while done < args.steps:
            steps = min(args.segment, args.steps - done)
            order = list(common.CONFIGS) if index % 2 == 0 else list(reversed(common.CONFIGS))
            times = {config: workers[config].run(steps) for config in order}
            rounds.append({"round": index, "steps": steps, "order": order, "segment_s": times})
            done += steps
            index += 1
            last = {config: workers[config].records[-1] for config in common.CONFIGS}
            if done >= args.steps:
                break
            print(
                f"step {done:3d}  "
                + "  ".join(
                    f"{c}: counter {r['counter']:4d} cache {harness.mib(r['cache_bytes'])}"
                    for c, r in last.items()
                ),
                file=sys.stderr,
            )
        # Timing-only rounds: the two fixed configurations, still alternating. Their steps are
        # not part of the memory figures (those are the first --steps steps of every worker).
        for extra in range(args.extra_rounds):
            order = [common.PACKAGE, common.UPSTREAM] if extra % 2 == 0 else [common.UPSTREAM, common.PACKAGE]
            times = {config: workers[config].run(args.segment) for config in order}
            rounds.append({"round": index, "steps": args.segment, "order": order, "segment_s": times})
            index += 1
        print(f"{args.extra_rounds} timing-only rounds done", file=sys.stderr)
    finally:
        for worker_ in workers.values():
            worker_.close()
    return summarise(args, workers, rounds)


def summarise(
    args: argparse.Namespace, workers: dict[str, Worker], rounds: list[dict[str, Any]]
) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for config, worker_ in workers.items():
        records = worker_.records[: args.steps]
        last = records[-1]
        final: dict[str, Any] = {
            "steps": len(records),
            "counter": last["counter"],
            "cache_entries": last["cache_entries"],
            "cache_bytes": last["cache_bytes"],
            "max_cache_bytes_after_a_step": max(r["cache_bytes"] for r in records),
            "median_step_s": harness.median([r["step_s"] for r in records]),
            "rss_bytes": last["rss_bytes"],
        }
        if "allocated_bytes" in last:
            final["allocated_bytes"] = last["allocated_bytes"]
            final["max_allocated_bytes"] = max(r["max_allocated_bytes"] for r in records)
            final["allocated_growth_bytes"] = last["allocated_bytes"] - records[0]["allocated_bytes"]
        configs[config] = {
            "description": common.DESCRIPTIONS[config],
            "env_BNB_GC_FIX": common.config_env(config).get("BNB_GC_FIX"),
            **worker_.ready,
            "final": final,
            "steps": records,
        }
    # The first round holds each worker's first step (lazy initialisation): left out.
    timed = rounds[1:] if len(rounds) > 1 else rounds
    ratios = [r["segment_s"][common.PACKAGE] / r["segment_s"][common.UPSTREAM] for r in timed]
    ratio = harness.Spread.of(ratios)
    unfixed_ratios = [
        r["segment_s"][common.PACKAGE] / r["segment_s"][common.UNFIXED]
        for r in timed
        if common.UNFIXED in r["order"]
    ]
    losses = {config: [r["loss"] for r in workers[config].records[: args.steps]] for config in common.CONFIGS}
    return {
        "benchmark": "memory",
        "device": args.device,
        "machine": harness.machine(),
        "settings": {
            "layers": args.layers,
            "experts": args.experts,
            "hidden": args.hidden,
            "batch": args.batch,
            "seq": args.seq,
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
            "ratio_package_over_upstream": {**ratio.record(), "per_round": ratios},
            "result": harness.verdict(ratio, floor=None),
            "ratio_package_over_unfixed": {"median": harness.median(unfixed_ratios)},
        },
        "losses_identical": losses[common.PACKAGE] == losses[common.UPSTREAM] == losses[common.UNFIXED],
        "notes": notes(args.device),
    }


def notes(device: str) -> list[str]:
    found = [
        "cache_bytes: bytes held by the tensors in torch's parametrization cache after each step, "
        "i.e. dequantized copies of 4-bit weights that nothing will free.",
        "unfixed steps are faster only because its cache is never emptied: it dequantizes each "
        "expert weight once and reuses that copy for ever (stale if the quantized data changed).",
    ]
    if not device.startswith("cuda"):
        found.append(
            "CPU: process RSS is dominated by the allocator (freed memory is not returned to the OS) "
            "and by the model build, so it is recorded but not a fair measure of the leak; the "
            "honest CPU figure is cache_bytes."
        )
    return found


def _row(config: str, final: dict[str, Any], cuda: bool) -> list[str]:
    cache = f"{final['cache_bytes']:,} ({harness.mib(final['cache_bytes'])})"
    row = [
        config,
        str(final["counter"]),
        str(final["cache_entries"]),
        cache,
        f"{final['median_step_s'] * 1e3:.0f} ms",
    ]
    if cuda:
        row += [harness.mib(final["allocated_bytes"]), harness.mib(final["max_allocated_bytes"])]
    return row


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    cuda = str(result["device"]).startswith("cuda")
    shape = f"{settings['layers']} layers, {settings['experts']} experts, hidden {settings['hidden']}"
    header = [
        "configuration",
        "counter after last step",
        "cache entries",
        "cache bytes retained",
        "median step",
    ]
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
    ]
    lines += [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--segment", type=int, default=5, help="steps per timed segment")
    parser.add_argument(
        "--extra-rounds", type=int, default=10, help="timing-only rounds after the memory steps (default 10)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 8 experts, hidden 128, 10 steps")
    parser.add_argument("--output", type=Path, help="result JSON (default results/memory-<device>.json)")
    parser.add_argument("--worker", choices=common.CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        quick = {"layers": 2, "experts": 8, "hidden": 128, "steps": 10, "segment": 2, "extra_rounds": 2}
        vars(args).update(quick)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return None
    started = time.perf_counter()
    result = drive(args)
    result["wall_s"] = time.perf_counter() - started
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    name = f"memory-{kind}{'-quick' if args.quick else ''}.json"
    output = harness.output_path(name, args.quick, args.output)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
