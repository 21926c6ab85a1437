"""``bnb-gc-fix run -- CMD ...``: run a command with the fix switched on at interpreter start.

For environments where site-packages ``.pth`` files are not processed (the package on a shared
``PYTHONPATH``, some embedded interpreters): it prepends the package's ``_sitecustomize``
directory to ``PYTHONPATH`` and executes the command, like ``ddtrace-run`` and
``opentelemetry-instrument``. Child processes inherit ``PYTHONPATH``, so every torchrun rank and
multiprocessing child is covered. That ``sitecustomize`` still loads the user's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

SITECUSTOMIZE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sitecustomize")


def environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) with our sitecustomize first on PYTHONPATH, the rest as it was
    (order, and empty entries, which Python reads as the current directory), less an earlier copy of ours."""
    env = dict(os.environ if base is None else base)
    existing = env.get("PYTHONPATH", "")
    entries = [SITECUSTOMIZE_DIR]
    if existing:
        entries += [p for p in existing.split(os.pathsep) if p != SITECUSTOMIZE_DIR]
    env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


def run(command: Sequence[str]) -> int:
    """Replace this process with ``command`` (POSIX), or run it and return its exit status."""
    if not command:
        print("bnb-gc-fix run: no command given; usage: bnb-gc-fix run -- CMD [ARGS ...]", file=sys.stderr)
        return 2
    env = environment()
    if shutil.which(command[0], path=env.get("PATH", os.defpath)) is None:
        if os.sep in command[0] and os.path.exists(command[0]):
            print(f"bnb-gc-fix run: {command[0]}: permission denied (not executable)", file=sys.stderr)
            return 126
        print(f"bnb-gc-fix run: {command[0]}: command not found", file=sys.stderr)
        return 127
    if os.name == "posix":
        try:
            os.execvpe(command[0], list(command), env)
        except OSError as error:
            print(f"bnb-gc-fix run: cannot run {command[0]!r}: {error}", file=sys.stderr)
            return 127
    return subprocess.call(list(command), env=env)
