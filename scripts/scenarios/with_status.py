"""Run a scenario script as ``__main__``, then print what bnb-gc-fix says about the process.

    python scripts/scenarios/with_status.py SCRIPT [ARGS...]

The script runs exactly as ``python SCRIPT ARGS...`` would run it (same ``sys.argv``, its own
folder first on ``sys.path``). Afterwards one JSON line ``{"status": ..., "versions": ...}`` is
printed: ``bnb_gc_fix.status()`` as a dict (``null`` when the package was never imported) and the
versions of torch, bitsandbytes and transformers that the process actually imported. This lets
scripts/matrix.py read the status of the very process that trained, without another interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import sys
from pathlib import Path
from typing import Any


def report() -> dict[str, Any]:
    fix = sys.modules.get("bnb_gc_fix")
    status = dataclasses.asdict(fix.status()) if fix is not None else None
    versions = {
        name: getattr(sys.modules.get(name), "__version__", None)
        for name in ("torch", "bitsandbytes", "transformers")
    }
    return {"status": status, "versions": versions}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [ARGS...]")
    script = Path(sys.argv[1]).resolve()
    sys.argv = sys.argv[1:]
    sys.path[0] = str(script.parent)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        print(json.dumps(report(), default=str), flush=True)


if __name__ == "__main__":
    main()
