"""The ``bnb-gc-fix`` command line: ``status`` and ``check``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from packaging.version import InvalidVersion, Version

from bnb_gc_fix import __version__
from bnb_gc_fix.installed import distribution_version, has_module, try_import
from bnb_gc_fix.libraries import AXOLOTL, BITSANDBYTES, LIBRARIES
from bnb_gc_fix.lines import counted, labelled, wrap
from bnb_gc_fix.releases import version_of
from bnb_gc_fix.status import NOT_AFFECTED, Status, for_a_job, status

EXIT_PROTECTED = 0  # check: no leak, either way
EXIT_LEAK = 1  # check: the cache stayed switched on, or the adapter's step died with a CheckpointError
EXIT_CANNOT_RUN = 2  # check: cannot run here (it says why); any command: a wrong command line


def _print_json(payload: dict[str, Any]) -> None:  # every command's JSON: one object, one line
    print(json.dumps(payload, sort_keys=True))


def _import_the_libraries() -> list[str]:
    """Import torch and what is installed of the libraries the fix goes into, so that it has something to
    look at; returns what failed to import, and why. Nothing is imported that is not installed, nor a
    module of a release from before the library had it."""
    torch, problem = try_import("torch")
    if torch is None:
        return [str(problem)]
    problems = []
    for library in LIBRARIES:
        if distribution_version(library.name) is None:
            continue
        top, problem = try_import(library.name)
        if top is not None and has_module(library.module_name):
            _, problem = try_import(library.module_name)
        if problem is not None:
            problems.append(problem)
    return problems


_NAMED = ("torch", "transformers", *(library.name for library in LIBRARIES))  # versions named


def _versions() -> dict[str, str | None]:
    """What a bug report needs: the versions installed (from their metadata; None: not installed)."""
    return {"bnb_gc_fix": __version__, "python": platform.python_version()} | {
        name: distribution_version(name) for name in _NAMED
    }


def _imported_versions() -> dict[str, str | None]:
    """The ``__version__`` of each library as imported in this process (None: not imported), read from
    ``sys.modules``: nothing is imported. A source checkout first on ``PYTHONPATH`` can differ from the
    installed metadata."""
    return {name: version_of(name) for name in _NAMED}


def _same(imported: str, installed: str) -> bool:
    """Whether two version strings name one version: ``1.0-rc1`` is ``1.0rc1``, and ``2.15.0+cu132`` is the
    ``2.15.0`` of its metadata (PyPI's CUDA builds of torch carry their local label in ``__version__``
    alone)."""
    try:
        first, second = Version(imported), Version(installed)
    except InvalidVersion:
        return imported == installed
    one_unlabelled = not (first.local and second.local)
    return first == second or (first.public == second.public and one_unlabelled)


def _versions_line() -> str:
    """One line: this package, Python, torch and bitsandbytes (installed or not), and transformers and
    axolotl where they are installed. Each names the version imported in this process, and the installed
    metadata's beside it where the two differ."""
    versions, imported = _versions(), _imported_versions()
    named = [f"Python {versions['python']}"]
    for name in ("torch", BITSANDBYTES.name, "transformers", AXOLOTL.name):
        version, loaded = versions[name], imported[name]
        if loaded is not None and version is not None and not _same(loaded, version):
            named.append(f"{name} {loaded} (installed: {version})")
        elif loaded is not None and version is None:
            named.append(f"{name} {loaded} (installed: none)")
        elif version is not None:
            named.append(f"{name} {version}")
        elif name in ("torch", BITSANDBYTES.name):
            named.append(f"{name} not installed")
    return wrap(f"bnb-gc-fix {__version__}: {', '.join(named)}")


#: What ``bnb-gc-fix status`` says of where its answer comes from.
READ_FROM_THE_CODE = (
    "this comes from reading the libraries' code, not from a job; in your job, print(bnb_gc_fix.status()) "
    "after a training step"
)


#: What a job here that uses bitsandbytes' layers alone gets: the same words as the README's.
LAYERS_ALONE = (
    "a job here that uses BitsAndBytesConfig alone (load_in_4bit or load_in_8bit) is not affected: its "
    "Linear4bit and Linear8bitLt layers never use this cache"
)


def _cmd_status(args: argparse.Namespace) -> int:
    """What a job in this environment that quantizes with each library gets (``status.for_a_job``); the
    command's own process under ``process`` in the JSON."""
    problems = _import_the_libraries()
    job = for_a_job()
    if args.json:
        facts: dict[str, Any] = {**_versions(), "imported": _imported_versions()}
        facts.update(job.as_dict())
        _print_json({**facts, "process": status().as_dict(), "import_errors": problems})
        return 0
    print(_versions_line())
    for line in job.lines(everywhere=True):
        print(line)
    for problem in problems:
        print(labelled("import", problem))
    print(labelled("note", LAYERS_ALONE))
    print(labelled("note", READ_FROM_THE_CODE))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from bnb_gc_fix import check

    result: check.CheckResult | None = None
    error: str | None = None
    try:
        result = check.run(device=args.device, steps=args.steps)
    except check.CannotRunError as cannot:
        error = str(cannot)
    except Exception as unexpected:  # a bug of ours must not read as a leak
        error = f"the check itself failed ({type(unexpected).__name__}: {unexpected})"
    current = status()
    code = EXIT_CANNOT_RUN if result is None else EXIT_PROTECTED if result.protected else EXIT_LEAK
    if args.json:
        payload: dict[str, Any] = {"device": args.device, "protected": None, "steps": []}
        if result is not None:
            payload.update(result.as_dict())
        payload.update(error=error, exit_code=code, status=current.as_dict())
        _print_json(payload)
    elif result is None:
        print(wrap(f"bnb-gc-fix check: cannot run: {error}", indent="  "), file=sys.stderr)
    else:
        _print_check(result, current)
    return code


def _print_check(result: Any, current: Status) -> None:
    bitsandbytes = current.library(BITSANDBYTES.name).version
    torch = version_of("torch")
    versions = f"bitsandbytes {bitsandbytes}, torch {torch}"
    print(f"bnb-gc-fix check: a small model of its own, device {result.device} ({versions})")
    print(result.status_line)  # as `bnb-gc-fix status` and status() say it, while the check's model was alive
    print(current.fix_line(everywhere=True))
    print("the routers trained, the quantized experts frozen; the cache after each step:")
    print(f"{'step':>4}  {'counter':>7}  {'cache bytes':>11}")
    for step in result.steps:
        print(f"{step.step:>4}  {step.counter:>7}  {step.cache_bytes:>11}")
    adapter = "an adapter trained through the quantized experts:"
    if result.adapter_error is None:
        print(f"{adapter} {counted(result.adapter_steps, 'step')} ran")
    else:
        print(wrap(f"{adapter} step {result.adapter_steps + 1} died: {result.adapter_error}", indent="  "))
    print(wrap(_verdict(result), indent="  "))


def _verdict(result: Any) -> str:
    """The check's last line: what it saw, in the state's word."""
    if result.protected and result.state == NOT_AFFECTED:
        return "not affected: this bitsandbytes switched the cache off after every step; nothing was needed"
    if result.protected:
        return "protected: the cache was switched off and empty after every step, and the adapter trained"
    faces = []
    if result.cache_left_on:
        faces.append(
            "the cache stayed switched on after a step, so every weight bitsandbytes unpacked stays in memory"
        )
    if result.adapter_error is not None:
        faces.append(
            "the CheckpointError comes from the same leak: the recompute started with the cache left on "
            "and saved fewer tensors than the forward did"
        )
    return f"LEAK: {'; '.join(faces)}."


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give the number of steps, e.g. 4")
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors reach main() (to answer in JSON under --json)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bnb-gc-fix", description="bitsandbytes' parametrization-cache leak: status and check."
    )
    parser.add_argument("--version", action="version", version=f"bnb-gc-fix {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="{status,check}")
    status_command = commands.add_parser(
        "status", help="where the fix stands, and the libraries it goes into"
    )
    status_command.add_argument("--json", action="store_true", help="print one JSON object")
    status_command.set_defaults(func=_cmd_status)
    check = commands.add_parser(
        "check",
        help="train a small model of its own both ways the leak shows; exit 0 no leak, 1 leak, 2 cannot run",
    )
    check.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    check.add_argument("--steps", type=_steps, default=4, help="optimizer steps (default 4)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_check)
    return parser


def _usage(error: _UsageError, argv: Sequence[str]) -> int:
    message = f"{error.parser.prog}: {error}"
    if "--json" in argv:
        payload: dict[str, Any] = {"error": message, "exit_code": EXIT_CANNOT_RUN}
        if "check" in argv:  # the shape of every other answer of check --json
            payload.update(device=None, protected=None, steps=[])
        _print_json(payload)
    else:
        error.parser.print_usage(sys.stderr)
        print(f"{error.parser.prog}: error: {error}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        try:
            args = parser.parse_args(arguments)
        except _UsageError as error:
            return _usage(error, arguments)
        if args.command is None:
            parser.print_help(sys.stderr)
            print("\nbnb-gc-fix: give a command: `bnb-gc-fix check` or `bnb-gc-fix status`", file=sys.stderr)
            return EXIT_CANNOT_RUN
        code: int = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # the reader went away (`bnb-gc-fix status --json | head -c 1`): a quiet exit
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
