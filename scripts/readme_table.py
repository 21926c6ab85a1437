"""Generate, and check, what the documentation shows as measured: the compatibility matrix and
every console transcript.

* **The matrix** (docs/matrix.md, between ``<!-- version-table:start -->`` and
  ``<!-- version-table:end -->``) is never typed by hand: each nox cell (cells.toml, noxfile.py) writes
  ``CELL.json`` (its versions and every test's outcome and recorded properties) into
  ``$BNB_GC_FIX_NOX/results`` (default ``~/.cache/bnb-gc-fix-nox/results``); this script gathers the
  cells of cells.toml from there into docs/matrix.json and renders the table from it. Without results
  (a machine that ran no cell) it renders from the committed docs/matrix.json.
* **Console transcripts**: every ``console`` block of README.md and docs/*.md lies between
  ``<!-- NAME-output:start -->`` and ``<!-- NAME-output:end -->``. Each line that starts with ``$ `` is a
  command, run in one bash shell per block from the repository root (so ``echo $?`` reads the command
  before it), with this interpreter's folder first on PATH (its ``python`` and ``bnb-gc-fix``) and
  ``BNB_GC_FIX`` unset; what it prints follows it. The environment they were made in (Python, torch,
  bitsandbytes, transformers) is recorded in docs/console-environment.json. pytest's closing line is
  compared without its duration.
* **The Quick start**: the ``bash`` blocks between ``<!-- quick-start:start -->`` and
  ``<!-- quick-start:end -->`` in README.md must be the very lines ``.ci/run`` runs between its
  ``# README.md, Quick start`` and ``# end of the README's commands`` markers.

    nox                                      # runs the cells, writes their results
    python scripts/readme_table.py           # regenerates all of it (the one command after a change)
    python scripts/readme_table.py --check   # CI, after nox: fail if the matrix table differs

The console blocks and the Quick start lines are checked by tests/test_readme.py, in the README's test
command: each block's commands run there as test_command_line.py runs them.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MATRIX = DOCS / "matrix.json"
MATRIX_PAGE = DOCS / "matrix.md"
CONSOLE_ENVIRONMENT = DOCS / "console-environment.json"
CELLS = ROOT / "cells.toml"
RESULTS = Path(os.environ.get("BNB_GC_FIX_NOX") or Path.home() / ".cache" / "bnb-gc-fix-nox") / "results"
START, END = "<!-- version-table:start -->", "<!-- version-table:end -->"
CI_RUN = ROOT / ".ci" / "run"
QUICK_START, QUICK_END = "<!-- quick-start:start -->", "<!-- quick-start:end -->"
CI_START, CI_END = "# README.md, Quick start", "# end of the README's commands"
_CONSOLE = re.compile(r"<!-- (?P<name>[a-z-]+-output):start -->(?P<body>.*?)<!-- (?P=name):end -->", re.S)
_FENCE = re.compile(r"```console\n(?P<content>.*?)```", re.S)
# Lines torch and bitsandbytes print on their own on a CPU-only machine; never ours.
FOREIGN = ("Failed to load CPU gemm_4bit_forward from kernels-community", "_check_is_size")
# pytest's closing line carries the run's duration (and its padding with it): compared without.
_PYTEST_LAST = re.compile(
    r"^(?:=+ )?(?P<summary>(?:\d+ \w+|no tests ran).*?) in [0-9.]+s(?: \([0-9:]+\))?(?: =+)?$", re.M
)
# A test the matrix reads records its role with record_property("matrix", ...): the fix's run, or its
# control's. Found by that, never by its name, so that a renamed test cannot silently drop out.
FIX, CONTROL = "fix", "control"


def documents() -> list[Path]:
    """The files whose console blocks are generated: README.md, then docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


def cell_names() -> list[str]:
    """The cells of cells.toml, in its order (a tomllib-free read: the names are all we need)."""
    return re.findall(r'^\s*\{\s*name\s*=\s*"([^"]+)"', CELLS.read_text(), re.M)


def gather(results: Path) -> dict[str, Any] | None:
    """docs/matrix.json's content from the cells' result files, each cell with the runs the table reads
    (those that recorded a role); None when no cell has results."""
    cells = [
        _with_roles_only(json.loads((results / f"{n}.json").read_text()))
        for n in cell_names()
        if (results / f"{n}.json").exists()
    ]
    if not cells:
        return None
    generated = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"generated_by": "nox (noxfile.py, cells.toml)", "generated": generated, "cells": cells}


def _with_roles_only(cell: dict[str, Any]) -> dict[str, Any]:
    """A cell's result with only the tests that recorded their role in the matrix (its counts keep every
    test)."""
    return {**cell, "tests": [test for test in cell["tests"] if "matrix" in test]}


def as_json(matrix: dict[str, Any]) -> str:
    """docs/matrix.json's text: a cell a line."""
    cells = ",\n".join("  " + json.dumps(cell, sort_keys=True) for cell in matrix["cells"])
    head = {key: value for key, value in matrix.items() if key != "cells"}
    return json.dumps(head, indent=1)[:-2] + ',\n "cells": [\n' + cells + "\n ]\n}\n"


def _counters(values: list[int] | None) -> str:
    return ", ".join(str(c) for c in values) if values else "-"


def _property(test: dict[str, Any], key: str) -> Any:
    """What a test recorded with record_property under ``key``, or None. junit XML holds the value as
    str() wrote it, so Python's True and False become JSON's before it is read."""
    value = test.get(key)
    if not value:
        return None
    return json.loads(value.replace("True", "true").replace("False", "false"))


def _tests(cell: dict[str, Any], role: str) -> dict[str, dict[str, Any]]:
    """The cell's runs of the tests that recorded ``matrix`` as ``role``, by parameter (``""`` when not
    parametrized)."""
    found = {}
    for test in cell["tests"]:
        if test["outcome"] == "skipped" or _property(test, "matrix") != role:
            continue
        function = test["test"].rsplit("::", 1)[-1]
        parameter = function[function.index("[") + 1 : -1] if "[" in function else ""
        found[parameter] = test
    return found


def _only(cell: dict[str, Any], role: str) -> dict[str, Any]:
    """The cell's one run of the test that recorded ``matrix`` as ``role`` ({} where none ran)."""
    return next(iter(_tests(cell, role).values()), {})


def _versions(cell: dict[str, Any]) -> tuple[str, str, str, str]:
    v = cell["versions"]
    torch = (v.get("torch") or "-").split("+")[0]
    return v["python"], torch, v.get("bitsandbytes") or "not installed", v.get("transformers") or "-"


def _verdict(cell: dict[str, Any]) -> str:
    counts = cell["counts"]
    skipped = f", {counts['skipped']} skipped" if counts.get("skipped") else ""
    return f"{cell['verdict']} ({counts['passed']} tests passed{skipped})"


def _matrix_rows(cell: dict[str, Any]) -> list[str]:
    """A matrix cell (tests/test_versions.py): one row per checkpointing variant it trained."""
    python, torch, bnb, transformers = _versions(cell)
    fixes = _tests(cell, FIX)
    controls = _tests(cell, CONTROL)
    rows = []
    if not fixes:  # no bitsandbytes, or one without bitsandbytes.nn.parametrize
        if bnb == "not installed":
            leak = "no"
            does = "nothing; imports cleanly, `status` says why"
        else:
            leak = "no: no `bitsandbytes.nn.parametrize`"
            does = "nothing; `status` says why"
        rows.append([python, torch, bnb, transformers, leak, does, "-"])
    for variant, fix in fixes.items():
        control = controls.get(variant, {})
        kind = _property(fix, "kind")
        leaked = _property(control, "counters") or []
        shown = transformers
        if transformers.startswith("4."):
            shown += f", `use_reentrant={_property(fix, 'use_reentrant')}`"
        if kind == "fixed-upstream":
            leak = f"no: upstream fix (counter {_counters(leaked)})"
            does = "steps aside"
        elif any(leaked):
            leak = f"**yes**: counter {_counters(leaked)}"
            does = "fixes it"
        else:
            leak = f"no: reentrant checkpointing (counter {_counters(leaked)})"
            does = "fixes it (nothing to fix)"
        rows.append(
            [python, torch, bnb, shown, leak, does, f"counter {_counters(_property(fix, 'counters'))}"]
        )
    return ["| " + " | ".join([*row, cell["verdict"]]) + " |" for row in rows]


def _stack_row(cell: dict[str, Any]) -> str:
    """A stack cell: its `pytest -m stack` run, counters from the tiny OLMoE leak test and its control."""
    python, torch, bnb, transformers = _versions(cell)
    fix, control = _only(cell, FIX), _only(cell, CONTROL)
    fixed = _property(fix, "counters") or []
    leaked = _property(control, "counters") or []
    does = "fixes it" if _property(fix, "state") == "protected" else "steps aside"
    leak = f"no: upstream fix (counter {_counters(leaked)})" if does == "steps aside" else "no"
    if any(leaked):
        leak = f"**yes**: counter {_counters(leaked)}"
    if transformers.startswith("4."):
        transformers += ", `use_reentrant=False`"
    row = [python, torch, bnb, transformers, leak, does, f"counter {_counters(fixed)}", _verdict(cell)]
    return "| " + " | ".join(row) + " |"


def _install_row(cell: dict[str, Any]) -> str:
    """The wheel cell and the cells without torch: the built wheel, installed into a fresh venv."""
    python, torch, bnb, transformers = _versions(cell)
    if cell["cell"]["marker"] == "bare":
        does = "the wheel: start-up hook silent and cheap, imports, `status` says why, `check` exits 2"
        return f"| {python} | not installed | {bnb} | {transformers} | - | {does} | - | {_verdict(cell)} |"
    fix, control = _only(cell, FIX), _only(cell, CONTROL)
    leaked = _property(control, "counters") or []
    leak = f"**yes**: counter {_counters(leaked)}" if any(leaked) else "no"
    does = "the wheel: its start-up hook alone fixes a copied script"
    row = [python, torch, bnb, transformers, leak, does, f"counter {_counters(_property(fix, 'counters'))}"]
    return "| " + " | ".join([*row, _verdict(cell)]) + " |"


def _generic_row(cell: dict[str, Any]) -> str:
    """A cell of a kind this script does not know yet: its versions and its verdict."""
    python, torch, bnb, transformers = _versions(cell)
    does = f"`pytest -m {cell['cell']['marker']}`"
    return f"| {python} | {torch} | {bnb} | {transformers} | - | {does} | - | {_verdict(cell)} |"


def render(matrix: dict[str, Any]) -> str:
    """The table between the markers of docs/matrix.md, from docs/matrix.json's content."""
    rows = []
    for cell in matrix["cells"]:
        marker = cell["cell"]["marker"]
        if marker == "matrix":
            rows += _matrix_rows(cell)
        elif marker == "stack":
            rows.append(_stack_row(cell))
        elif marker in ("wheel", "bare"):
            rows.append(_install_row(cell))
        else:
            rows.append(_generic_row(cell))
    lines = [
        START,
        "| Python | torch | bitsandbytes | transformers | leaks without the fix? | bnb-gc-fix "
        "| with bnb-gc-fix | verdict |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
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


def fences(text: str, name: str) -> list[str]:
    """The console fences' contents (commands and what they print) of the generated block ``name``."""
    blocks = [match for match in _CONSOLE.finditer(text) if match["name"] == name]
    return [fence["content"] for block in blocks for fence in _FENCE.finditer(block["body"])]


def ungenerated_console_fences(text: str) -> int:
    """How many ``console`` fences of ``text`` lie outside every generated block (should be none)."""
    return len(_FENCE.findall(_CONSOLE.sub("", text)))


def environment() -> dict[str, str | None]:
    """What the console output depends on besides the package: the interpreter and the stack."""

    def version(distribution: str) -> str | None:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return None

    stack = {name: version(name) for name in ("torch", "bitsandbytes", "transformers")}
    return {"python": platform.python_version(), **stack}


def recorded_environment() -> dict[str, str | None] | None:
    """The environment the committed console blocks were generated in (None: not recorded)."""
    if not CONSOLE_ENVIRONMENT.exists():
        return None
    recorded: dict[str, str | None] = json.loads(CONSOLE_ENVIRONMENT.read_text())
    return recorded


def _run_commands(commands: list[str]) -> str:
    """Run the commands in one bash shell; return the transcript as a console block shows it."""
    marker = "@@bnb-gc-fix-readme@@"
    script = "".join(f'__rc=$?; echo "{marker}{i}"; (exit $__rc); {c}\n' for i, c in enumerate(commands))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BNB_GC_FIX", "PYTHONPATH") and not k.startswith("PYTEST_")
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
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
        printed = [line for line in output.splitlines() if not any(n in line for n in FOREIGN)]
        if not printed:  # every documented command prints something: a blank block is a broken run
            raise SystemExit(f"`{command}` printed nothing here; is this the Quick start's environment?")
        lines.append(f"$ {command}")
        lines += printed
    return "\n".join(lines) + "\n"


def render_console(text: str, only: str | None = None) -> str:
    """``text`` with every generated console block's output (or only block ``only``'s) produced afresh."""

    def fence(match: re.Match[str]) -> str:
        commands = [line[2:] for line in match["content"].splitlines() if line.startswith("$ ")]
        return f"```console\n{_run_commands(commands)}```"

    def block(match: re.Match[str]) -> str:
        if only is not None and match["name"] != only:
            return match.group(0)
        return match.group(0).replace(match["body"], _FENCE.sub(fence, match["body"]))

    return _CONSOLE.sub(block, text)


def comparable(block: str) -> str:
    """A console block as compared: pytest's closing line without its duration."""
    return _PYTEST_LAST.sub(lambda m: f"{m['summary']} in (time)", block)


def show_diff(document: Path, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(), after.splitlines(), f"{document.name} (committed)", "now", lineterm=""
    )
    return "\n".join(lines)


def _newest_unnamed(matrix: dict[str, Any]) -> dict[str, Any]:
    """The matrix with each version a cell resolves at run time (``"*"`` in cells.toml) read as "newest"."""
    cells = []
    for cell in matrix["cells"]:
        versions = dict(cell["versions"])
        for library, spec in cell["cell"].items():
            if spec == "*" and library in versions:
                versions[library] = "newest"
        cells.append({**cell, "versions": versions})
    return {**matrix, "cells": cells}


def _table_matches(matrix: dict[str, Any]) -> bool:
    """Whether docs/matrix.md's table is the one the matrix results render, or differs from it only in the
    releases a cell resolves at run time (a release published since docs/matrix.json was committed); if
    not, say so."""
    page = MATRIX_PAGE.read_text()
    table = render(matrix)
    if _replace(page, table) == page:
        return True
    committed = json.loads(MATRIX.read_text())
    same_but_newest = render(_newest_unnamed(matrix)) == render(_newest_unnamed(committed))
    if same_but_newest and _replace(page, render(committed)) == page:
        print(
            "docs/matrix.md: newer releases resolved since it was made, with the same outcomes",
            file=sys.stderr,
        )
        return True
    print("docs/matrix.md's table differs from the matrix results, which say:\n", file=sys.stderr)
    print(table, file=sys.stderr)
    return False


def _check(matrix: dict[str, Any]) -> int:
    """``--check``: 0 when docs/matrix.md's table is what the matrix results say, else 1 (the console
    blocks and the Quick start lines are checked by tests/test_readme.py, in the README's test command)."""
    if not _table_matches(matrix):
        print("\nrun: python scripts/readme_table.py --table-only", file=sys.stderr)
        return 1
    print("docs/matrix.md's table matches the matrix results")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if anything differs; change nothing")
    parser.add_argument("--results", type=Path, default=RESULTS, help="default: %(default)s")
    parser.add_argument("--table-only", action="store_true", help="leave the console blocks alone")
    args = parser.parse_args(argv)
    fresh = gather(args.results)
    matrix = fresh if fresh is not None else json.loads(MATRIX.read_text())
    if args.check:
        return _check(matrix)
    if fresh is not None:
        MATRIX.write_text(as_json(fresh))
    MATRIX_PAGE.write_text(_replace(MATRIX_PAGE.read_text(), render(matrix)))
    if not args.table_only:
        for document in documents():
            text = document.read_text()
            updated = render_console(text)
            if updated != text:
                document.write_text(updated)
        CONSOLE_ENVIRONMENT.write_text(json.dumps(environment(), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
