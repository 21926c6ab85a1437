"""``bnb-gc-fix run -- CMD ...``: the fix switched on at interpreter start where ``.pth`` files are not
processed (the package on a shared ``PYTHONPATH``, embedded interpreters), like ``ddtrace-run``: the
folder of our ``sitecustomize`` (``_bnb_gc_fix/runner_path``) goes first on ``PYTHONPATH``, which every
torchrun rank and multiprocessing child inherits; it still loads the user's own ``sitecustomize``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from _bnb_gc_fix import startup

EXIT_NOT_EXECUTABLE = 126  # the shell's status for a command found but not run
EXIT_NOT_FOUND = 127  # the shell's status for a command that is not found

SITECUSTOMIZE_DIR = os.path.join(startup.PACKAGE_DIR, "runner_path")


def environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) with our sitecustomize first on PYTHONPATH, the rest as it was
    (order, and empty entries, which Python reads as the current directory), less an earlier copy of ours."""
    env = dict(os.environ if base is None else base)
    entries = env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([SITECUSTOMIZE_DIR, *(p for p in entries if p != SITECUSTOMIZE_DIR)])
    return env


def run(command: Sequence[str], usage: int) -> int:
    """Replace this process with ``command`` (POSIX), or run it and return its exit status; ``usage``
    is the exit status when no command is given."""
    if not command:
        print("bnb-gc-fix run: no command given; usage: bnb-gc-fix run -- CMD [ARGS ...]", file=sys.stderr)
        return usage
    env = environment()
    if shutil.which(command[0], path=env.get("PATH", os.defpath)) is None:
        if os.sep in command[0] and os.path.exists(command[0]):
            print(f"bnb-gc-fix run: {command[0]}: permission denied (not executable)", file=sys.stderr)
            return EXIT_NOT_EXECUTABLE
        print(f"bnb-gc-fix run: {command[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    if os.name == "posix":
        try:
            os.execvpe(command[0], list(command), env)
        except OSError as error:
            print(f"bnb-gc-fix run: cannot run {command[0]!r}: {error}", file=sys.stderr)
            return EXIT_NOT_EXECUTABLE
    return subprocess.call(list(command), env=env)
