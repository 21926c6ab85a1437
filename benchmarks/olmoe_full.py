"""Memory at the bug report's real size: OLMoE-1B-7B's shapes, four ways, 1 to 16 layers.

The model is ``_olmoe_full.py``'s: allenai/OLMoE-1B-7B-0924's configuration with random weights,
the attention projections 4-bit ``Linear4bit`` (as a 4-bit ``from_pretrained`` makes them), both
fused expert stacks of every layer quantized with ``replace_parameter_4bit`` (nf4), only the 16
router gates trainable (AdamW), batch 1, sequence length 300, ``use_cache=False``: the report's loop.
Four columns, each in a fresh interpreter, one after the other:

* ``unfixed``        bitsandbytes 0.49.2 as installed, ``BNB_GC_FIX=0``, ``gradient_checkpointing_enable()``;
* ``bnb-gc-fix``     the same with ``import bnb_gc_fix``;
* ``upstream-0.50``  ``BNB_GC_FIX=0`` and upstream 0.50's hooks patched in (``_common.apply_upstream_fix``);
* ``workaround``     ``BNB_GC_FIX=0``, HF checkpointing off, and every experts module's bare forward
  wrapped in non-reentrant ``torch.utils.checkpoint`` (the report's workaround, verbatim).

Every step records the parametrization-cache counter, the bytes held by the cache, the process's
resident memory now and its peak (``VmRSS`` / ``VmHWM``; the peak is reset after the build by
writing 5 to ``/proc/self/clear_refs``), and the step time; on CUDA ``memory_allocated()`` and
``max_memory_allocated()`` (peak reset before each step). The driver watches each worker's
resident memory and stops it above ``--rss-limit-gib`` (or when the machine runs short), recording
how far it got; a column stopped at one layer count is not started at the larger ones.

    python benchmarks/olmoe_full.py --prepare            # quantize the 16 layers once (the cache)
    python benchmarks/olmoe_full.py                      # layers 1 2 4 8 16: results/olmoe-full-cpu.*
    python benchmarks/olmoe_full.py --layers 1 --steps 2 # the anchor
    python benchmarks/olmoe_full.py --smoke              # reduced width, same code path (results/tmp/)
    python benchmarks/olmoe_full.py --device cuda        # on a GPU (gpu.py --full), no cache
    python benchmarks/olmoe_full.py --report             # rewrite the .md from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import _common as common
import _harness as harness
import _olmoe_full as full

WORKAROUND = "workaround"
COLUMNS = (common.UNFIXED, common.PACKAGE, common.UPSTREAM, WORKAROUND)
DESCRIPTIONS = {
    **common.DESCRIPTIONS,
    WORKAROUND: (
        "bitsandbytes as installed, BNB_GC_FIX=0, HF checkpointing off, each experts module's forward "
        "wrapped in non-reentrant torch.utils.checkpoint (the report's workaround)"
    ),
}
LAYERS = (1, 2, 4, 8, 16)
SEQ = 300
GIB = 2**30


def _env(column: str) -> dict[str, str]:
    return common.config_env(common.UNFIXED if column == WORKAROUND else column)


# --------------------------------------------------------------------------- the worker


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (bytes) of a process, from /proc; empty where there is no /proc."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _workaround(model: Any) -> None:
    """The report's workaround, as written there: checkpoint each experts module's bare forward."""
    import torch
    import torch.utils.checkpoint as cpk

    for layer in model.model.layers:
        ex = layer.mlp.experts
        orig = ex.forward

        def make_ckpt_fwd(orig: Any) -> Any:
            def fwd(*args: Any, **kwargs: Any) -> Any:
                if torch.is_grad_enabled():
                    return cpk.checkpoint(orig, *args, use_reentrant=False, **kwargs)
                return orig(*args, **kwargs)

            return fwd

        ex.forward = make_ckpt_fwd(orig)


def _fix_state(column: str) -> dict[str, Any]:
    import bitsandbytes.nn.parametrize as bnb_parametrize

    state: dict[str, Any] = {
        "bnb_gc_fix_imported": "bnb_gc_fix" in sys.modules,
        "register_hooks": getattr(bnb_parametrize._register_parametrization_hooks, "__module__", None),
    }
    if "bnb_gc_fix" in sys.modules:
        status = sys.modules["bnb_gc_fix"].status()
        state["active"] = status.active
    if column == common.PACKAGE and not state.get("active"):
        raise SystemExit(f"bnb-gc-fix is not active in the {column} worker: {state}")
    if column != common.PACKAGE and state["bnb_gc_fix_imported"]:
        raise SystemExit(f"bnb_gc_fix was imported in the {column} worker (is BNB_GC_FIX=0 set?)")
    return state


def worker(args: argparse.Namespace) -> None:
    column = args.worker
    if column == common.PACKAGE:
        import bnb_gc_fix  # noqa: F401  (the import activates the fix)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if column == common.UPSTREAM:
        common.apply_upstream_fix()
    device = args.device
    cuda = device.startswith("cuda")
    shape = full.SMOKE if args.smoke else None
    cache_root = None if (cuda or args.no_cache) else args.cache
    started = time.perf_counter()
    layers_info: list[dict[str, Any]] = []
    model = full.build_model(
        args.layers,
        device=device,
        cache_root=cache_root,
        shape=shape,
        chunk=full.SMOKE_CHUNK if args.smoke else full.CHUNK,
        on_layer=layers_info.append,
    )
    if column == WORKAROUND:
        _workaround(model)
    else:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=generator).to(device)
    if cuda:
        torch.cuda.synchronize()
    build_status = proc_status()
    harness.emit(
        {
            "ready": column,
            "build_s": time.perf_counter() - started,
            "layers_from_cache": sum(1 for info in layers_info if info["from_cache"]),
            "fix": _fix_state(column),
            "trainable_parameters": sum(parameter.numel() for parameter in trainable),
            "expert_parameters_per_layer": full.expert_parameters_per_layer(model.config),
            "rss_after_build": build_status.get("VmRSS"),
            "peak_rss_of_build": build_status.get("VmHWM"),
            "peak_reset": _reset_peak(),
            "allocated_after_build": torch.cuda.memory_allocated() if cuda else None,
            "torch_threads": torch.get_num_threads(),
        }
    )
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        counter, entries, cached = common.cache_state()
        status = proc_status()
        record: dict[str, Any] = {
            "step": step,
            "step_s": elapsed,
            "loss": float(loss.item()),
            "counter": counter,
            "cache_entries": entries,
            "cache_bytes": cached,
            "rss_bytes": status.get("VmRSS"),
            "peak_rss_bytes": status.get("VmHWM"),
        }
        if cuda:
            record["allocated_bytes"] = torch.cuda.memory_allocated()
            record["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        harness.emit({"record": record})


# --------------------------------------------------------------------------- the driver


def _available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_column(column: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """One worker, watched: its messages, its resident memory sampled twice a second, why it ended."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        column,
        "--layers",
        str(layers),
        "--steps",
        str(args.steps),
        "--seq",
        str(args.seq),
        "--device",
        args.device,
        "--cache",
        str(args.cache),
        "--threads",
        str(args.threads),
    ]
    command += ["--smoke"] if args.smoke else []
    command += ["--no-cache"] if args.no_cache else []
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=_env(column), cwd=harness.ROOT)
    messages: list[dict[str, Any]] = []

    def read(stdout: IO[str]) -> None:
        for line in stdout:
            message = harness.message_of(line)
            if message is not None:
                messages.append(message)

    reader = threading.Thread(target=read, args=(process.stdout,), daemon=True)
    reader.start()
    stopped: str | None = None
    samples: list[tuple[float, int]] = []
    limit = int(args.rss_limit_gib * GIB)
    while process.poll() is None:
        rss = proc_status(process.pid).get("VmRSS")
        now = time.perf_counter() - started
        if rss is not None:
            samples.append((round(now, 2), rss))
        available = _available()
        steps_done = sum(1 for m in messages if "record" in m)
        if rss is not None and rss > limit:
            stopped = f"resident memory {rss / GIB:.2f} GiB above the limit of {args.rss_limit_gib} GiB"
        elif available is not None and available < args.min_available_gib * GIB:
            stopped = (
                f"the machine had {available / GIB:.2f} GiB available (minimum {args.min_available_gib})"
            )
        elif now > args.run_timeout:
            stopped = f"ran past {args.run_timeout} s"
        if stopped:
            stopped += (
                f" during step {steps_done + 1}" if any("ready" in m for m in messages) else " while building"
            )
            process.kill()
            break
        time.sleep(0.5)
    code = process.wait()
    reader.join(timeout=10)
    ready = next((m for m in messages if "ready" in m), {})
    records = [m["record"] for m in messages if "record" in m]
    if stopped is None and code != 0:
        stopped = f"exited with status {code}"
    return {
        "column": column,
        "layers": layers,
        "description": DESCRIPTIONS[column],
        "env_BNB_GC_FIX": _env(column).get("BNB_GC_FIX"),
        "wall_s": time.perf_counter() - started,
        "stopped": stopped,
        **{k: v for k, v in ready.items() if k != "ready"},
        "steps": records,
        "rss_samples": samples[:: max(1, len(samples) // 400)],
    }


def expected_cache_bytes(column: str, layers: int, parameters_per_layer: int) -> int:
    """What the cache holds after every step: every expert stack that ran (bf16) unfixed, else 0."""
    return layers * parameters_per_layer * 2 if column == common.UNFIXED else 0


def summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    records = run["steps"]
    per_layer = run.get("expert_parameters_per_layer")
    summary: dict[str, Any] = {"steps_done": len(records), "stopped": run["stopped"]}
    if not records or per_layer is None:
        return summary
    expected = expected_cache_bytes(run["column"], run["layers"], per_layer)
    last = records[-1]
    summary.update(
        {
            "counters": [r["counter"] for r in records],
            "cache_bytes": [r["cache_bytes"] for r in records],
            "expected_cache_bytes": expected,
            "cache_vs_expected": (last["cache_bytes"] / expected) if expected else None,
            "within_1_percent": (
                all(abs(r["cache_bytes"] - expected) <= 0.01 * expected for r in records)
                if expected
                else all(r["cache_bytes"] == 0 for r in records)
            ),
            "rss_after_build": run.get("rss_after_build"),
            "peak_rss_of_build": run.get("peak_rss_of_build"),
            "peak_rss_training": max(r["peak_rss_bytes"] or 0 for r in records),
            "rss_after_last_step": last["rss_bytes"],
            "first_step_s": records[0]["step_s"],
            "median_step_s": harness.median([r["step_s"] for r in records[1:] or records]),
        }
    )
    if "max_allocated_bytes" in last:
        summary["allocated_after_last_step"] = last["allocated_bytes"]
        summary["max_allocated_bytes"] = max(r["max_allocated_bytes"] for r in records)
    return summary


def anchor(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The issue's anchor: one layer, two steps; unfixed counter 2 then 4 and 805,306,368 bytes."""
    one = {run["column"]: run for run in runs if run["layers"] == 1}
    if common.UNFIXED not in one or len(one[common.UNFIXED]["steps"]) < 2:
        return None
    per_layer = one[common.UNFIXED]["expert_parameters_per_layer"]
    unfixed = one[common.UNFIXED]["steps"][:2]
    result: dict[str, Any] = {
        "unfixed_counters": [r["counter"] for r in unfixed],
        "unfixed_cache_bytes": [r["cache_bytes"] for r in unfixed],
        "expected_bytes": per_layer * 2,
    }
    ok = result["unfixed_counters"] == [2, 4] and result["unfixed_cache_bytes"] == [per_layer * 2] * 2
    for column in (common.PACKAGE, common.UPSTREAM, WORKAROUND):
        if column in one and len(one[column]["steps"]) >= 2:
            steps = one[column]["steps"][:2]
            result[f"{column}_counters"] = [r["counter"] for r in steps]
            result[f"{column}_cache_bytes"] = [r["cache_bytes"] for r in steps]
            ok = ok and result[f"{column}_counters"] == [0, 0] and result[f"{column}_cache_bytes"] == [0, 0]
    result["reproduced"] = ok
    return result


def drive(args: argparse.Namespace, output: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "olmoe-full",
        "device": args.device,
        "machine": harness.machine(),
        "settings": {
            "model": "allenai/OLMoE-1B-7B-0924 shapes" if not args.smoke else "reduced width (smoke)",
            "shape": {k: v for k, v in (full.SMOKE if args.smoke else full.OLMOE_1B_7B).items()},
            "layer_counts": args.layers,
            "columns": args.columns,
            "steps": args.steps,
            "batch": 1,
            "seq": args.seq,
            "dtype": "bfloat16",
            "quantization": "nf4, blocksize 64, no double quantization; experts via replace_parameter_4bit, "
            "attention projections Linear4bit, router gates and lm_head bfloat16",
            "trainable": "router gates (.mlp.gate.) only, AdamW lr 1e-4",
            "rss_limit_gib": args.rss_limit_gib,
            "cache": None if (args.no_cache or args.device.startswith("cuda")) else str(args.cache),
        },
        "runs": [],
    }
    started = time.perf_counter()
    stopped_at: dict[str, str] = {}
    for layers in args.layers:
        for column in args.columns:
            if column in stopped_at:
                result["runs"].append(
                    {"column": column, "layers": layers, "skipped": stopped_at[column], "steps": []}
                )
                continue
            print(f"{layers:2d} layers, {column}: running", file=sys.stderr, flush=True)
            run = run_column(column, layers, args)
            run["summary"] = summarise_run(run)
            result["runs"].append(run)
            _progress(run)
            if run["stopped"]:
                stopped_at[column] = f"stopped at {layers} layers: {run['stopped']}"
            result["wall_s"] = time.perf_counter() - started
            result["anchor"] = anchor(result["runs"])
            harness.write_json(output, result)  # after every run, so a stopped benchmark keeps its figures
    result["largest_layer_count"] = {
        column: max(
            (
                r["layers"]
                for r in result["runs"]
                if r["column"] == column
                and not r.get("skipped")
                and r["summary"]["steps_done"] == args.steps
                and not r["stopped"]
            ),
            default=None,
        )
        for column in args.columns
    }
    result["wall_s"] = time.perf_counter() - started
    return result


def _progress(run: dict[str, Any]) -> None:
    s = run["summary"]
    if "counters" not in s:
        print(f"   {run['column']}: no step ({run['stopped']})", file=sys.stderr, flush=True)
        return
    print(
        f"   {run['column']}: counters {s['counters']} cache {[harness.mib(b) for b in s['cache_bytes']]} "
        f"(expected {harness.mib(s['expected_cache_bytes'])}), "
        f"peak RSS {s['peak_rss_training'] / GIB:.2f} GiB, "
        f"step {s['median_step_s']:.1f} s, build {run.get('build_s', 0):.0f} s"
        + (f"; STOPPED: {run['stopped']}" if run["stopped"] else ""),
        file=sys.stderr,
        flush=True,
    )


def _gb(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 1e9:.2f} GB"


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    machine = result["machine"]
    cuda = str(result["device"]).startswith("cuda")
    lines = [
        f"OLMoE-1B-7B shapes ({settings['model']}), random weights, bfloat16, nf4; "
        f"batch 1x{settings['seq']}, "
        f"router gates trained, {settings['steps']} steps per run on {result['device']}; "
        f"torch {machine.get('torch')}, bitsandbytes {machine.get('bitsandbytes')}, "
        f"transformers {machine.get('transformers')}, {machine.get('cpu_count')} CPUs "
        f"({machine.get('processor')}). Wall time {result.get('wall_s', 0) / 60:.1f} min.",
        "",
        "| layers | column | steps | counter per step | cache bytes after last step | expected | "
        + ("peak allocated | " if cuda else "peak RSS (training) | RSS after build | ")
        + "median step | stopped |",
        "|---:|---|---:|---|---:|---:|---:|" + ("" if cuda else "---:|") + "---:|---|",
    ]
    for run in result["runs"]:
        if run.get("skipped"):
            lines.append(
                f"| {run['layers']} | {run['column']} | - | | | | |"
                + ("" if cuda else " |")
                + f" | skipped ({run['skipped']}) |"
            )
            continue
        s = run["summary"]
        if "counters" not in s:
            lines.append(
                f"| {run['layers']} | {run['column']} | 0 | | | | |"
                + ("" if cuda else " |")
                + f" | {run['stopped']} |"
            )
            continue
        expected = s["expected_cache_bytes"]
        ratio = f" ({s['cache_vs_expected']:.4f}x)" if s["cache_vs_expected"] is not None else ""
        memory = (
            f"{_gb(s['max_allocated_bytes'])} | "
            if cuda
            else f"{_gb(s['peak_rss_training'])} | {_gb(s['rss_after_build'])} | "
        )
        lines.append(
            f"| {run['layers']} | {run['column']} | {s['steps_done']} | "
            f"{', '.join(map(str, s['counters']))} | "
            f"{s['cache_bytes'][-1]:,}{ratio} | {expected:,} | {memory}{s['median_step_s']:.1f} s | "
            f"{run['stopped'] or ''} |"
        )
    anchor_ = result.get("anchor")
    if anchor_:
        lines += [
            "",
            f"Anchor (1 layer, first 2 steps): unfixed counters {anchor_['unfixed_counters']}, cache bytes "
            f"{[f'{b:,}' for b in anchor_['unfixed_cache_bytes']]} (expected {anchor_['expected_bytes']:,}); "
            f"reproduced: **{anchor_['reproduced']}**.",
        ]
    same = losses_identical(result)
    lines += [
        "",
        f"Losses identical in every column at every layer count and step: **{same}** (every worker "
        "rebuilt the same model; the cache-rebuilt layers are the quantized random weights).",
        "",
        "- expected: unfixed, every expert stack that ran stays dequantized in the cache "
        "(layers x 402,653,184 parameters x 2 bytes); every other column 0.",
        "- peak RSS (training): VmHWM after the last step, reset after the build (clear_refs); "
        "RSS after build: VmRSS once the quantized model was built.",
        "- median step: steps after the first; the first step includes lazy initialisation.",
    ]
    return "\n".join(lines) + "\n"


def losses_identical(result: dict[str, Any]) -> bool:
    """Whether every column that ran at a layer count saw the same loss at every step."""
    by_layers: dict[int, list[list[float]]] = {}
    for run in result["runs"]:
        if run["steps"]:
            by_layers.setdefault(run["layers"], []).append([r["loss"] for r in run["steps"]])
    return all(
        all(a == b for a, b in zip(losses[0], other)) for losses in by_layers.values() for other in losses[1:]
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    parser.add_argument("--columns", nargs="+", choices=COLUMNS, default=list(COLUMNS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: torch's)")
    parser.add_argument("--cache", type=Path, default=full.DEFAULT_CACHE, help="quantization cache folder")
    parser.add_argument("--no-cache", action="store_true", help="quantize in every worker, keep nothing")
    parser.add_argument("--rss-limit-gib", type=float, default=19.0)
    parser.add_argument("--min-available-gib", type=float, default=1.0)
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per worker")
    parser.add_argument("--prepare", action="store_true", help="only build the quantization cache")
    parser.add_argument("--report", action="store_true", help="only rewrite the .md from the result JSON")
    parser.add_argument("--smoke", action="store_true", help="reduced width, same code path; results/tmp/")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--worker", choices=COLUMNS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker and len(args.layers) != 1:
        parser.error("a worker runs one layer count")
    return args


def prepare(args: argparse.Namespace) -> None:
    """Check the chunked quantization against one call, then quantize every layer into the cache."""
    check = full.check_chunking()
    print(f"chunked quantize_4bit == one call: {check}", file=sys.stderr)
    started = time.perf_counter()
    full.build_model(
        max(args.layers),
        cache_root=args.cache,
        shape=full.SMOKE if args.smoke else None,
        chunk=full.SMOKE_CHUNK if args.smoke else full.CHUNK,
        on_layer=lambda info: print(
            f"layer {info['layer']}: {'cached' if info['from_cache'] else 'quantized'} "
            f"in {info['build_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        ),
    )
    print(f"cache ready in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.worker:
        args.layers = args.layers[0]
        worker(args)
        return None
    if args.prepare:
        prepare(args)
        return None
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    folder = harness.RESULTS / "tmp" if args.smoke else harness.RESULTS
    output: Path = args.output or folder / f"olmoe-full-{kind}{'-smoke' if args.smoke else ''}.json"
    if args.report:
        result = json.loads(output.read_text())
        harness.write_text(output.with_suffix(".md"), markdown(result))
        return result
    check = (
        None
        if kind == "cuda" or args.no_cache
        else full.check_chunking(
            numel=2**16 if args.smoke else 6 * 2**20, chunk=5000 if args.smoke else 2**20 + 3 * 64
        )
    )
    result = drive(args, output)
    result["chunking_check"] = check
    result["losses_identical"] = losses_identical(result)
    harness.write_results(output, result, markdown(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    main()
