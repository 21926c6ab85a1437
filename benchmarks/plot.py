"""docs/memory.png from results/memory-cpu.json (and memory-cuda.json), and with ``--full``
docs/memory-olmoe.png from results/olmoe-full-cpu.json (the panels: benchmarks/README.md). Needs matplotlib
(the ``benchmark`` extra).

    python benchmarks/plot.py --full results/olmoe-full-cuda.json --output docs/memory-olmoe-cuda.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import _common as common
import _harness as harness

STYLE = {
    common.UNFIXED: {"color": "#c0392b", "linestyle": "-", "linewidth": 2.2},
    common.PACKAGE: {"color": "#2471a3", "linestyle": "-", "linewidth": 2.2},
    common.UPSTREAM: {"color": "#27ae60", "linestyle": "--", "linewidth": 2.2},
}


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, output: Path) -> None:
    figure.tight_layout(h_pad=2.0)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    _pyplot().close(figure)
    print(f"wrote {output}", file=sys.stderr)


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _series(
    result: dict[str, Any], config: str, key: str, scale: float = 1.0
) -> tuple[list[int], list[float]]:
    steps = result["configs"][config]["steps"]
    return [record["step"] + 1 for record in steps], [record[key] / scale for record in steps]


def _title(result: dict[str, Any]) -> str:
    settings = result["settings"]
    machine = result["machine"]
    return (
        f"{result['device'].upper()}: tiny OLMoE {settings['layers']}x{settings['experts']} experts, "
        f"hidden {settings['hidden']}, bitsandbytes {machine.get('bitsandbytes')}, "
        f"torch {machine.get('torch')}"
    )


def plot(cpu: dict[str, Any] | None, cuda: dict[str, Any] | None, output: Path) -> None:
    plt = _pyplot()
    rows: list[tuple[dict[str, Any], str, str, str]] = []
    for result in (cpu, cuda):
        if result is None:
            continue
        rows.append(
            (result, "cache_bytes", "parametrization cache (MiB)", "Dequantized weights held by the cache")
        )
        rows.append((result, "counter", "P._cache_enabled", "Cache counter (0 = cache off and emptied)"))
        if harness.is_cuda(result["device"]):
            rows.append(
                (result, "allocated_bytes", "allocated (MiB)", "torch.cuda.memory_allocated() after the step")
            )
            rows.append(
                (result, "max_allocated_bytes", "peak allocated (MiB)", "torch.cuda.max_memory_allocated()")
            )
    if not rows:
        raise SystemExit("no memory result to plot: run benchmarks/memory.py first")
    columns = 2
    lines = (len(rows) + columns - 1) // columns
    figure, axes = plt.subplots(lines, columns, figsize=(12, 1.0 + 3.4 * lines), squeeze=False)
    for index, (result, key, ylabel, title) in enumerate(rows):
        axis = axes[index // columns][index % columns]
        scale = 2**20 if key.endswith("bytes") else 1.0
        for config in common.CONFIGS:
            x, y = _series(result, config, key, scale)
            final = result["configs"][config]["final"]
            label = config
            if key == "cache_bytes":
                label = f"{config}: {final['cache_bytes'] / 2**20:.1f} MiB held after step {final['steps']}"
            elif key == "counter":
                label = f"{config}: {final['counter']} after step {final['steps']}"
            axis.plot(x, y, label=label, **STYLE[config])
        axis.set_title(f"{str(result['device']).upper()}: {title}", fontsize=10)
        axis.set_xlabel("training step")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="best")
    for index in range(len(rows), lines * columns):
        axes[index // columns][index % columns].set_visible(False)
    heading = (
        "4-bit parametrization cache under gradient checkpointing: unfixed vs bnb-gc-fix vs upstream fix"
    )
    subtitles = "\n".join(_title(result) for result in (cpu, cuda) if result is not None)
    figure.suptitle(f"{heading}\n{subtitles}", fontsize=10)
    _save(figure, output)


FULL_STYLE = {**STYLE, "workaround": {"color": "#d68910", "linestyle": ":", "linewidth": 2.4}}


def _largest_shared(result: dict[str, Any]) -> int:
    """The largest layer count at which every column recorded at least one step."""
    columns = result["settings"]["columns"]
    counts = sorted({run["layers"] for run in result["runs"]}, reverse=True)
    for layers in counts:
        ran = {run["column"] for run in result["runs"] if run["layers"] == layers and run["steps"]}
        if all(column in ran for column in columns):
            return int(layers)
    return int(counts[-1])


def plot_full(result: dict[str, Any], output: Path) -> None:
    """docs/memory-olmoe.png: cache bytes and memory over the steps of the largest layer count every
    column ran (top), and against the layer count (bottom)."""
    plt = _pyplot()
    cuda = harness.is_cuda(result["device"])
    memory_key, peak_key, memory_label = (
        ("allocated_bytes", "max_allocated_bytes", "CUDA memory allocated")
        if cuda
        else ("rss_bytes", "peak_rss_bytes", "resident memory (VmRSS)")
    )
    columns = result["settings"]["columns"]
    layers = _largest_shared(result)
    runs = {(run["column"], run["layers"]): run for run in result["runs"]}
    figure, axes = plt.subplots(2, 2, figsize=(13, 8.5), squeeze=False)
    cache_axis, memory_axis = axes[0]
    for column in columns:
        run = runs.get((column, layers))
        if not run or not run["steps"]:
            continue
        x = [record["step"] + 1 for record in run["steps"]]
        style = FULL_STYLE[column]
        cache_axis.plot(x, [r["cache_bytes"] / 1e9 for r in run["steps"]], marker="o", label=column, **style)
        memory_axis.plot(
            x,
            [(r[memory_key] or 0) / 1e9 for r in run["steps"]],
            marker="o",
            label=f"{column} after step",
            **style,
        )
        memory_axis.plot(
            x,
            [(r[peak_key] or 0) / 1e9 for r in run["steps"]],
            marker="^",
            color=style["color"],
            linestyle="none",
            markersize=8,
            label=f"{column} peak",
        )
    cache_axis.set_title(
        f"{layers} layers: dequantized weights held by the parametrization cache", fontsize=10
    )
    cache_axis.set_ylabel("GB")
    memory_axis.set_title(f"{layers} layers: {memory_label} after each step, and its peak", fontsize=10)
    memory_axis.set_ylabel("GB")
    for axis in (cache_axis, memory_axis):
        axis.set_xlabel("training step")
        axis.set_xticks(sorted({r["step"] + 1 for run in result["runs"] for r in run["steps"]}))
    by_layers_cache, by_layers_peak = axes[1]
    counts = sorted({run["layers"] for run in result["runs"]})
    for column in columns:
        summaries = {n: runs[(column, n)].get("summary", {}) for n in counts if (column, n) in runs}
        points = [(n, s) for n, s in summaries.items() if "counters" in s]
        if not points:
            continue
        style = FULL_STYLE[column]
        by_layers_cache.plot(
            [n for n, _ in points],
            [s["cache_bytes"][-1] / 1e9 for _, s in points],
            marker="o",
            label=column,
            **style,
        )
        peak = "max_allocated_bytes" if cuda else "peak_rss_training"
        by_layers_peak.plot(
            [n for n, _ in points], [s[peak] / 1e9 for _, s in points], marker="o", label=column, **style
        )
    per_layer = max((run.get("expert_parameters_per_layer") or 0 for run in result["runs"]), default=0)
    if per_layer:
        by_layers_cache.plot(
            counts,
            [n * per_layer * 2 / 1e9 for n in counts],
            color="black",
            linestyle=(0, (1, 3)),
            linewidth=1,
            label="expected unfixed: layers x 805,306,368 B",
        )
    by_layers_cache.set_title("cache bytes after the last step, by layer count", fontsize=10)
    by_layers_peak.set_title(
        ("peak allocated" if cuda else "peak resident memory during training") + ", by layer count",
        fontsize=10,
    )
    for axis in (by_layers_cache, by_layers_peak):
        axis.set_xlabel("decoder layers (OLMoE-1B-7B has 16)")
        axis.set_ylabel("GB")
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [str(n) for n in counts])
    for axis in (cache_axis, memory_axis, by_layers_cache, by_layers_peak):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    machine = result["machine"]
    shape = result["settings"]["shape"]
    figure.suptitle(
        f"{result['settings']['model']} (hidden {shape['hidden_size']}, {shape['num_experts']} experts, "
        f"top-{shape['num_experts_per_tok']}), nf4, router-only training, {str(result['device']).upper()}\n"
        f"bitsandbytes {machine.get('bitsandbytes')}, "
        f"torch {machine.get('torch')}, transformers {machine.get('transformers')}: "
        "unfixed vs bnb-gc-fix vs upstream's fix vs the report's workaround",
        fontsize=10,
    )
    _save(figure, output)


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--cpu", type=Path, default=harness.RESULTS / "memory-cpu.json")
    parser.add_argument("--cuda", type=Path, default=harness.RESULTS / "memory-cuda.json")
    parser.add_argument("--output", type=Path, default=harness.DOCS / "memory.png")
    parser.add_argument(
        "--full",
        type=Path,
        nargs="?",
        const=harness.RESULTS / "olmoe-full-cpu.json",
        help="plot olmoe_full.py's result (default results/olmoe-full-cpu.json) to docs/memory-olmoe.png",
    )
    args = parser.parse_args(argv)
    if args.full is not None:
        result = _load(args.full)
        if result is None:
            raise SystemExit(f"no {args.full}: run benchmarks/olmoe_full.py first")
        output = (
            args.output if args.output != harness.DOCS / "memory.png" else harness.DOCS / "memory-olmoe.png"
        )
        plot_full(result, output)
        return
    plot(_load(args.cpu), _load(args.cuda), args.output)


if __name__ == "__main__":
    main()
