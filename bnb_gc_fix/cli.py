"""The ``bnb-gc-fix`` command line: ``status``, ``check`` and ``run``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import _bnb_gc_fix as words
from bnb_gc_fix import __version__, activation
from bnb_gc_fix.installed import distribution_version, import_installed
from bnb_gc_fix.status import status as fix_status

if TYPE_CHECKING:
    from bnb_gc_fix import check


def _print_json(payload: dict[str, Any]) -> None:  # every command's JSON: one object, one line
    print(json.dumps(payload, sort_keys=True))


def _cmd_status(args: argparse.Namespace) -> int:
    import_installed()  # so that the fix has something to decide on; every sentence comes from status()
    current = fix_status()
    transformers = distribution_version("transformers")
    facts = {"bnb_gc_fix": __version__, "python": platform.python_version(), "transformers": transformers}
    if args.json:
        _print_json({**facts, **current.as_dict()})
        return 0
    print(
        f"bnb-gc-fix {__version__} (Python {facts['python']}, transformers {transformers or 'not installed'})"
    )
    print(current)
    return 0


EXIT_PROTECTED = 0  # check: the counter and the cache were back to zero after every step
EXIT_LEAK = 1  # check: the leak was observed
EXIT_CANNOT_RUN = 2  # check: cannot run here (the message says why)
EXIT_USAGE = 2  # any command: the command line was wrong


def _cmd_check(args: argparse.Namespace) -> int:
    """Every path ends with 0, 1 or 2 and, with --json, exactly one JSON object on stdout."""
    from bnb_gc_fix import check

    result: check.CheckResult | None = None
    error: str | None = None
    try:
        result = check.run(device=args.device, steps=args.steps)
    except check.CannotRunError as cannot:
        error = str(cannot)
    except Exception as unexpected:  # a bug of ours must not read as "leak observed"
        error = f"the check itself failed ({type(unexpected).__name__}: {unexpected})"
    current = fix_status()
    code = _check_exit_code(result)
    args.exit_code = code  # what main() returns even if stdout is closed while printing
    if args.json:
        payload: dict[str, Any] = {"device": args.device, "protected": None, "steps": []}
        if result is not None:
            payload.update(result.as_dict())
        payload.update(error=error, exit_code=code, status=current.as_dict())
        _print_json(payload)
        return code
    if result is None:
        print(f"bnb-gc-fix check: cannot run: {error}", file=sys.stderr)
        return code
    print(
        f"bnb-gc-fix check: bitsandbytes {current.bitsandbytes.version}, torch {current.torch}, "
        f"device {result.device}, fix {current.state}"
    )
    print(f"{'step':>4}  {'counter':>7}  {'cache bytes':>11}")
    for step in result.steps:
        print(f"{step.step:>4}  {step.counter:>7}  {step.cache_bytes:>11}")
    if result.protected:
        print("protected: the counter and the cache were back to zero after every step")
    else:
        print(
            "LEAK: the parametrization cache stayed switched on after a step, so dequantized weights "
            f"stay resident. The fix is {current.state} here: {current.reason}."
        )
    return code


def _check_exit_code(result: check.CheckResult | None) -> int:
    if result is None:
        return EXIT_CANNOT_RUN
    if result.protected:
        return EXIT_PROTECTED
    return EXIT_LEAK


def _cmd_run(args: argparse.Namespace) -> int:
    from bnb_gc_fix import runner

    return runner.run(args.argv[1:] if args.argv[:1] == ["--"] else args.argv, usage=EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bnb-gc-fix",
        description="Diagnose and stop bitsandbytes' 4-bit cache leak under gradient checkpointing.",
    )
    parser.add_argument("--version", action="version", version=f"bnb-gc-fix {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="{status,check,run}")

    status = commands.add_parser(
        "status", help="versions, whether this bitsandbytes is affected, whether the fix is on"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_cmd_status)

    check = commands.add_parser(
        "check",
        help="reproduce the leak's shape on a small synthetic model; exit 0 protected, 1 leak, 2 cannot run",
    )
    check.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    check.add_argument("--steps", type=_positive, default=4, help="optimizer steps (default 4)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_check)

    run = commands.add_parser(
        "run", help="run CMD with the fix switched on at interpreter start: run -- CMD ..."
    )
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="CMD", help="the command to run, after --")
    run.set_defaults(func=_cmd_run)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give the number of steps, e.g. 4")
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


class _UsageError(Exception):
    """A usage error that argparse found, carried to :func:`main`."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors reach :func:`main` (to answer in JSON under ``--json``)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _usage_error(error: _UsageError, argv: Sequence[str]) -> int:
    parser = error.parser
    message = error.message
    if "--json" in argv:
        payload: dict[str, Any] = {"error": f"{parser.prog}: {message}", "exit_code": EXIT_USAGE}
        if "check" in argv:
            payload.update(device=None, protected=None, steps=[])
        _print_json(payload)
    else:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    activation.credit(words.VIA_COMMAND)  # this command's own import of the package turned it on
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = argparse.Namespace()
    try:
        try:
            args = parser.parse_args(argv)
        except _UsageError as error:
            return _usage_error(error, argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            print(
                "\nbnb-gc-fix: give a command, e.g. `bnb-gc-fix check` or `bnb-gc-fix status`",
                file=sys.stderr,
            )
            return EXIT_USAGE
        result: int = args.func(args)
        sys.stdout.flush()
        return result
    except BrokenPipeError:
        # The reader went away (`bnb-gc-fix status --json | head -c 1`): a quiet exit. Python's
        # own flush at exit would fail too, so stdout now points at the null device.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return int(getattr(args, "exit_code", 0))
