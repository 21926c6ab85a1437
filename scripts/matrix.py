"""Version matrix for bnb-gc-fix: which bitsandbytes/transformers combinations leak, and what the fix does.

    python scripts/matrix.py    # full matrix; writes docs/version-table.md and docs/version-matrix.json
    python scripts/matrix.py --only bnb-0.49.2 bnb-0.50.2 --no-write

Standard library only. It uses the interpreter that runs it (with torch, transformers 5.x and
bnb-gc-fix installed) and never touches its torch: every bitsandbytes release is installed with
``pip install --no-deps --target <cache>/bnb-X bitsandbytes==X`` and put in front of the children's
``PYTHONPATH``; transformers 4.57.x goes into ``<cache>/transformers-4.57.N`` together with the
dependencies of it that the environment does not already satisfy (``pip install --dry-run
--report`` says which). The cache is reused by later runs, also from other clones: it defaults to
``$BNB_GC_FIX_MATRIX_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/bnb-gc-fix-matrix``, outside the
work tree on purpose (``python -m build`` would otherwise pick files out of it into the sdist).

"No bitsandbytes at all" is a real absence, not a stub: a fresh ``python -m venv --without-pip``
whose site-packages holds symlinks to every entry of this interpreter's site-packages except
``bitsandbytes`` and its ``.dist-info``. bitsandbytes is then neither importable nor known to
``importlib.metadata``, exactly as if it had never been installed, while the package and its
start-up ``.pth`` hook are present as usual.

Each cell runs in fresh child interpreters (at most ``--jobs`` at a time): the fix run, a training
scenario with ``BNB_GC_FIX`` unset, and the control, the same with ``BNB_GC_FIX=0``. Both import
``bnb_gc_fix`` explicitly (``--import-fix``) and run under ``scripts/scenarios/with_status.py``,
which prints ``bnb_gc_fix.status()`` of the process that trained, so the status columns and the
control's "switched off" come from the runs themselves. Cells without a trainable bitsandbytes
(none, 0.47) run a probe of the public API plus ``bnb-gc-fix status --json`` and ``check --json``.
Exit status: 0 every cell met its expectation, 1 some cell did not, 2 the matrix could not be set up.

This file is the command line; the rest is split by job: ``matrix_cells.py`` (the cells, as data: a
new cell is one line there), ``matrix_setup.py`` (installs), ``matrix_children.py`` (the child
interpreters), ``matrix_judge.py`` (running and judging the cells), ``matrix_report.py`` (tables).
Other torch builds and Pythons: ``scripts/stacks.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from matrix_cells import CELLS, REPO, TF4_SPEC
from matrix_judge import Matrix
from matrix_report import document, environment, markdown, reasons
from matrix_setup import SetupError


def default_cache() -> Path:
    if os.environ.get("BNB_GC_FIX_MATRIX_CACHE"):
        return Path(os.environ["BNB_GC_FIX_MATRIX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bnb-gc-fix-matrix"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cache-dir", type=Path, default=default_cache(), help="default: %(default)s")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="children at a time")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--only", nargs="+", metavar="CELL", help="run only these cells (see --list)")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--refresh", action="store_true", help="reinstall the cached packages")
    parser.add_argument("--transformers4", default=TF4_SPEC, help=f"pip spec (default {TF4_SPEC!r})")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/version-*")
    parser.add_argument("--docs-dir", type=Path, default=REPO / "docs")
    args = parser.parse_args(argv)

    if args.list:
        for cell in CELLS:
            print(f"{cell.name:28} {cell.kind:16} {cell.note}")
        return 0
    cells = CELLS
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in CELLS})
        if unknown:
            parser.error(f"unknown cells {unknown}; see --list")
        cells = [c for c in CELLS if c.name in args.only]
    args.cache_dir = args.cache_dir.resolve()
    started = time.monotonic()
    import importlib.util

    if importlib.util.find_spec("bnb_gc_fix") is None:
        print("matrix: bnb_gc_fix is not importable here; pip install -e . first", file=sys.stderr)
        return 2
    try:
        rows = Matrix(args).run(cells)
    except (SetupError, subprocess.CalledProcessError, OSError) as error:
        print(f"matrix: cannot set up: {error}", file=sys.stderr)
        return 2
    seconds = time.monotonic() - started
    for row in rows:  # keep the JSON small: child output tails only where a cell failed
        for child in row["children"].values():
            child.pop("json", None)
            child["pythonpath"] = [p.replace(str(args.cache_dir), "<cache>") for p in child["pythonpath"]]
            if row["verdict"] == "PASS":
                child.pop("stdout_tail", None)
                child.pop("stderr_tail", None)
    env = environment()
    table = markdown(rows)
    print(table)
    print()
    print(reasons(rows))
    full = not args.only
    if full and not args.no_write:
        command = "python scripts/matrix.py"
        args.docs_dir.mkdir(parents=True, exist_ok=True)
        (args.docs_dir / "version-table.md").write_text(document(rows, env, command, seconds, args.steps))
        payload = {
            "generated_by": command,
            "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1),
            "environment": env,
            "steps": args.steps,
            "layers": args.layers,
            "cells": rows,
        }
        (args.docs_dir / "version-matrix.json").write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.docs_dir / 'version-table.md'} and {args.docs_dir / 'version-matrix.json'}")
    failed = [row["cell"] for row in rows if row["verdict"] != "PASS"]
    print(f"\nmatrix: {len(rows) - len(failed)}/{len(rows)} cells PASS in {seconds:.0f} s", end="")
    print(f"; FAILED: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
