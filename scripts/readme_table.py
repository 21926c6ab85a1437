"""Render the README's "Who needs this" table from the version matrix's results.

The table between ``<!-- version-table:start -->`` and ``<!-- version-table:end -->`` in
README.md is generated, never typed by hand:

    python scripts/matrix.py                 # runs the matrix, writes docs/version-matrix.json
    python scripts/stacks.py                 # runs the stack cells, writes docs/stack-matrix.json
    python scripts/readme_table.py           # rewrites the README's table from that JSON
    python scripts/readme_table.py --check   # CI: fail if the README's table differs

Only facts the matrix re-proves on every run go in (versions, counters, what the package did,
verdicts), so the same code gives the same table on every machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MATRIX = ROOT / "docs" / "version-matrix.json"
STACKS = ROOT / "docs" / "stack-matrix.json"
START, END = "<!-- version-table:start -->", "<!-- version-table:end -->"


def _counters(run: dict[str, Any] | None) -> str:
    if not run or not run.get("counters"):
        return "-"
    return ", ".join(str(c) for c in run["counters"])


def _transformers(cell: dict[str, Any]) -> str:
    version = cell.get("transformers") or "-"
    if str(version).startswith("4."):
        reentrant = cell.get("checkpointing") != "non-reentrant"
        return f"{version}, `use_reentrant={reentrant}`"
    return str(version)


def _row(cell: dict[str, Any], python: str, torch: str) -> str:
    kind = cell["kind"]
    bnb = cell.get("bitsandbytes") or "not installed"
    control, fix = cell.get("control"), cell.get("fix")
    if kind == "no-bitsandbytes":
        leak, does, result = "no", "nothing; imports cleanly, `status()` says why", "-"
    elif kind == "no-parametrize":
        leak, does, result = "no: no `bitsandbytes.nn.parametrize`", "nothing; `status()` says why", "-"
    elif kind == "fixed-upstream":
        leak = f"no: upstream fix (counter {_counters(control)})"
        does, result = "steps aside", f"counter {_counters(fix)}"
    elif kind == "no-leak":
        leak = f"no: reentrant checkpointing (counter {_counters(control)})"
        does, result = "patches (harmless)", f"counter {_counters(fix)}"
    else:
        leak = f"**yes**: counter {_counters(control)}"
        does, result = "patches", f"counter {_counters(fix)}"
    cells = [python, torch, bnb, _transformers(cell), leak, does, result, cell["verdict"]]
    return "| " + " | ".join(cells) + " |"


def _test(cell: dict[str, Any], name: str) -> dict[str, Any]:
    return next((t for t in cell["tests"] if t["test"].endswith("::" + name)), {})


def _stack_row(cell: dict[str, Any]) -> str:
    """A stack cell: its `pytest -m stack` run, counters from the tiny OLMoE leak test and its control."""
    fix = _test(cell, "test_tiny_olmoe_with_fix_ends_every_step_at_zero")
    control = _test(cell, "test_tiny_olmoe_control_leaks_without_fix")
    fixed, leaked = json.loads(fix.get("counters", "[]")), json.loads(control.get("counters", "[]"))
    shown = {"counters": leaked}, {"counters": fixed}
    does = "patches" if fix.get("active") == "True" else "steps aside"
    leak = f"no: upstream fix (counter {_counters(shown[0])})" if does == "steps aside" else "no"
    if any(leaked):
        leak = f"**yes**: counter {_counters(shown[0])}"
    transformers = str(cell["transformers"])
    if transformers.startswith("4."):
        transformers += ", `use_reentrant=False`"
    counts = cell["counts"]
    verdict = f"{cell['verdict']} ({counts['passed']}/{len(cell['tests'])} stack tests)"
    return (
        f"| {cell['python']} | {cell['torch']} | {cell['bitsandbytes']} | {transformers} | {leak} | {does} | "
        f"counter {_counters(shown[1])} | {verdict} |"
    )


def render(matrix: dict[str, Any], stacks: dict[str, Any]) -> str:
    environment = matrix.get("environment", {})
    python = environment.get("python", "?")
    torch = environment.get("torch", "?")
    lines = [
        START,
        f"Generated from the version matrix (`python scripts/matrix.py`, re-run by CI on every change) on "
        f"Python {python}, torch {torch}, CPU: the counter is torch's parametrization-cache counter "
        f"after each of {matrix.get('steps', 3)} checkpointed training steps; above 0 is the leak. "
        "The rows below them are the stack cells (`python scripts/stacks.py`): each its own interpreter "
        "and torch build (PyPI's CUDA builds, run on the CPU) running the core tests (`pytest -m stack`: "
        "leak and control, Ctrl-C, threads, torchrun, Trainer, `check`, `status`); counters from its "
        "5-step leak test (tiny OLMoE; on transformers 4.x a tiny Llama, the shape that leaks there).",
        "",
        "| Python | torch | bitsandbytes | transformers | leaks without the fix? | bnb-gc-fix "
        "| with bnb-gc-fix | verdict |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(cell, python, torch.split("+")[0]) for cell in matrix["cells"]),
        *(_stack_row(cell) for cell in stacks.get("cells", [])),
        END,
    ]
    return "\n".join(lines)


def _replace(text: str, block: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the README's table differs")
    parser.add_argument("--matrix", type=Path, default=MATRIX)
    parser.add_argument("--stacks", type=Path, default=STACKS)
    args = parser.parse_args(argv)
    stacks = json.loads(args.stacks.read_text()) if args.stacks.exists() else {}
    block = render(json.loads(args.matrix.read_text()), stacks)
    text = README.read_text()
    updated = _replace(text, block)
    if args.check:
        if updated != text:
            print("README.md's version table differs from the matrix results, which say:\n", file=sys.stderr)
            print(block, file=sys.stderr)
            print("\nrun: python scripts/readme_table.py", file=sys.stderr)
            return 1
        print("README.md's version table matches the matrix results")
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
