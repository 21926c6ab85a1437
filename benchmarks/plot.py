"""docs/memory.png, shown in benchmarks/README.md: the cache's bytes and counter per step from
results/memory-cpu.json (and CUDA memory from results/memory-cuda.json where gpu.py wrote it). Needs
matplotlib (the ``benchmark`` extra).

    python benchmarks/plot.py                  # docs/memory.png
    python benchmarks/plot.py --output x.png   # elsewhere
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import _harness as harness

STYLE = {
    harness.UNFIXED: {"color": "#c0392b", "linestyle": "-", "linewidth": 2.2},
    harness.PACKAGE: {"color": "#2471a3", "linestyle": "-", "linewidth": 2.2},
    harness.UPSTREAM: {"color": "#27ae60", "linestyle": "--", "linewidth": 2.2},
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
        for config in harness.CONFIGS:
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


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--cpu", type=Path, default=harness.RESULTS / "memory-cpu.json")
    parser.add_argument("--cuda", type=Path, default=harness.RESULTS / "memory-cuda.json")
    parser.add_argument("--output", type=Path, default=harness.DOCS / "memory.png")
    args = parser.parse_args(argv)
    plot(_load(args.cpu), _load(args.cuda), args.output)


if __name__ == "__main__":
    main()
