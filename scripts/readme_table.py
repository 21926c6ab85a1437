"""Render the README's generated parts: the version table and the real console output.

The table between ``<!-- version-table:start -->`` and ``<!-- version-table:end -->`` in
README.md is generated from the version matrix, never typed by hand. So is every ``console``
block between ``<!-- NAME-output:start -->`` and ``<!-- NAME-output:end -->``: each line that
starts with ``$ `` is a command, run in one bash shell per block from the repository root (so
``echo $?`` reads the command before it), and what it prints follows it.

    python scripts/matrix.py                 # runs the matrix, writes docs/version-matrix.json
    python scripts/stacks.py                 # runs the stack cells, writes docs/stack-matrix.json
    python scripts/readme_table.py           # rewrites the README's table and console output
    python scripts/readme_table.py --check   # CI: fail if either differs

Only facts the matrix re-proves on every run go in the table (versions, counters, what the
package did, verdicts), so the same code gives the same table on every machine. The console
blocks show this machine's real output (versions included), so ``--check`` also fails when the
command line's output changes without the README.

The README's Quick start commands (``bash`` blocks between ``<!-- quick-start:start -->`` and
``<!-- quick-start:end -->``) must be the very lines ``.ci/run`` runs between its
``# README.md, Quick start`` and ``# end of the README's commands`` markers; ``--check`` and the
test suite compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MATRIX = ROOT / "docs" / "version-matrix.json"
STACKS = ROOT / "docs" / "stack-matrix.json"
START, END = "<!-- version-table:start -->", "<!-- version-table:end -->"
CI_RUN = ROOT / ".ci" / "run"
QUICK_START, QUICK_END = "<!-- quick-start:start -->", "<!-- quick-start:end -->"
CI_START, CI_END = "# README.md, Quick start", "# end of the README's commands"
_CONSOLE = re.compile(r"<!-- (?P<name>[a-z-]+-output):start -->(?P<body>.*?)<!-- (?P=name):end -->", re.S)
_FENCE = re.compile(r"```console\n(?P<content>.*?)```", re.S)
# Lines torch and bitsandbytes print on their own on a CPU-only machine; never ours.
_FOREIGN = ("Failed to load CPU gemm_4bit_forward from kernels-community", "_check_is_size")


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
    skipped = f", {counts['skipped']} skipped" if counts.get("skipped") else ""
    verdict = f"{cell['verdict']} ({counts['passed']} tests passed{skipped})"
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
        "5-step leak test (tiny OLMoE; on transformers 4.x a tiny Llama, the shape that leaks there). "
        "The Python 3.13 cell with bitsandbytes 0.49.2 also runs the axolotl tests (0.17.0-0.21.0); the "
        "one skip in each cell is the notebook tests, which need ipykernel (not installed in the cells).",
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


def _between(text: str, start: str, end: str) -> str:
    return text[text.index(start) + len(start) : text.index(end)]


def quick_start_commands(readme: str | None = None) -> list[str]:
    """The command lines of the README's Quick start (its ``bash`` blocks), in order."""
    section = _between(README.read_text() if readme is None else readme, QUICK_START, QUICK_END)
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def ci_commands() -> list[str]:
    """The lines ``.ci/run`` runs as the README's Quick start."""
    section = _between(CI_RUN.read_text(), CI_START, CI_END)
    lines = section.splitlines()[1:]  # the rest of the marker's own line is a comment
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def console_blocks(text: str) -> dict[str, list[str]]:
    """Every generated console block's commands, by block name."""
    blocks: dict[str, list[str]] = {}
    for match in _CONSOLE.finditer(text):
        commands = blocks.setdefault(match["name"], [])
        for fence in _FENCE.finditer(match["body"]):
            commands += [line[2:] for line in fence["content"].splitlines() if line.startswith("$ ")]
    return blocks


def _run_commands(commands: list[str]) -> str:
    """Run the commands in one bash shell; return the transcript as a console block shows it."""
    marker = "@@bnb-gc-fix-readme@@"
    script = "".join(f'__rc=$?; echo "{marker}{i}"; (exit $__rc); {c}\n' for i, c in enumerate(commands))
    env = {k: v for k, v in os.environ.items() if k not in ("BNB_GC_FIX", "PYTHONPATH")}
    completed = subprocess.run(
        ["bash", "-c", script + f'echo "{marker}end"'],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    outputs = re.split(rf"^{re.escape(marker)}(?:\d+|end)\n", completed.stdout, flags=re.M)[1:]
    lines: list[str] = []
    for command, output in zip(commands, outputs):
        lines.append(f"$ {command}")
        lines += [line for line in output.splitlines() if not any(n in line for n in _FOREIGN)]
    return "\n".join(lines) + "\n"


def render_console(text: str) -> str:
    """``text`` with every generated console block's output produced afresh."""

    def fence(match: re.Match[str]) -> str:
        commands = [line[2:] for line in match["content"].splitlines() if line.startswith("$ ")]
        return f"```console\n{_run_commands(commands)}```"

    def block(match: re.Match[str]) -> str:
        return match.group(0).replace(match["body"], _FENCE.sub(fence, match["body"]))

    return _CONSOLE.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the README's table differs")
    parser.add_argument("--matrix", type=Path, default=MATRIX)
    parser.add_argument("--table-only", action="store_true", help="leave the console blocks alone")
    parser.add_argument("--stacks", type=Path, default=STACKS)
    args = parser.parse_args(argv)
    stacks = json.loads(args.stacks.read_text()) if args.stacks.exists() else {}
    block = render(json.loads(args.matrix.read_text()), stacks)
    text = README.read_text()
    updated = _replace(text, block)
    with_console = updated if args.table_only else render_console(updated)
    if args.check:
        failed = 0
        if updated != text:
            print("README.md's version table differs from the matrix results, which say:\n", file=sys.stderr)
            print(block, file=sys.stderr)
            failed = 1
        if with_console != updated:
            new = [m.group(0) for m in _CONSOLE.finditer(with_console)]
            old = [m.group(0) for m in _CONSOLE.finditer(updated)]
            for before, after in zip(old, new):
                if before != after:
                    print(f"README.md's console output differs; now:\n{after}\n", file=sys.stderr)
            failed = 1
        if quick_start_commands() != ci_commands():
            print(
                f"README.md's Quick start commands {quick_start_commands()} are not the lines .ci/run "
                f"runs {ci_commands()}",
                file=sys.stderr,
            )
            failed = 1
        if failed:
            print("\nrun: python scripts/readme_table.py; keep .ci/run's Quick start lines", file=sys.stderr)
            return 1
        print("README.md's version table, console output and Quick start commands match")
        return 0
    README.write_text(with_console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
