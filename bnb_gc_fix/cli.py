"""The ``bnb-gc-fix`` command line: ``status``, ``check`` and ``run``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import _bnb_gc_fix_boot as boot
from bnb_gc_fix import __version__, decide
from bnb_gc_fix.activation import bitsandbytes_verdict, gil_enabled
from bnb_gc_fix.activation import status as fix_status
from bnb_gc_fix.installed import distribution_version, failure, try_import
from bnb_gc_fix.targets import BITSANDBYTES, TARGETS


def _facts() -> dict[str, Any]:
    """Everything ``status`` reports, gathered once (imports torch and bitsandbytes if present).

    The decision and every sentence about it come from :func:`bnb_gc_fix.status`; this only
    imports what is installed, so that the fix has something to decide on, and renders.
    """
    watcher = boot.installed_watcher()
    facts: dict[str, Any] = {
        "bnb_gc_fix": __version__,
        "python": platform.python_version(),
        "gil": gil_enabled(),  # False: free-threaded build without the GIL (an untested path)
        "torch": None,
        "bitsandbytes": None,
        "transformers": distribution_version("transformers"),
        "switch": None,
        "mode": boot.mode(),
        "startup_hook": watcher is not None or boot.started_by is not None,
        "startup_hook_switched_off": watcher is None and boot.trigger is None and boot.started_by is not None,
        "in_affected_range": None,
        "probe": None,
        "affected": None,
        "verdict": None,
        "import_errors": {},
    }
    torch, problem = try_import("torch")
    if torch is None:
        facts["verdict"] = f"{problem}; nothing to patch"
        facts["import_errors"]["torch"] = problem
    else:
        facts["torch"] = str(getattr(torch, "__version__", "unknown"))
        bitsandbytes, problem = try_import("bitsandbytes")
        if bitsandbytes is None:
            facts["verdict"] = f"{problem}; nothing to patch"
            facts["import_errors"]["bitsandbytes"] = problem
        else:
            facts["bitsandbytes"] = str(getattr(bitsandbytes, "__version__", "unknown"))
            parametrize, problem = try_import(decide.PARAMETRIZE)
            if parametrize is None:
                version = facts["bitsandbytes"]
                if decide.before_parametrize(version):
                    facts["verdict"] = f"{decide.no_parametrize(version)}; nothing to patch"
                else:
                    facts["verdict"] = f"{problem}; nothing to patch"
                    facts["import_errors"][decide.PARAMETRIZE] = problem
        _import_look_alikes(facts["import_errors"])
    facts["in_affected_range"] = decide.in_affected_range(facts["bitsandbytes"])
    verdict = bitsandbytes_verdict()
    if verdict is not None:
        facts["probe"] = verdict.probe
        facts["affected"] = verdict.affected
        facts["verdict"] = verdict.reason
    current = fix_status()
    facts.update(
        active=current.active,
        state=current.state,
        reason=current.reason,
        via=current.via,
        switch=current.switch,
        libraries=[dataclasses.asdict(library) for library in current.libraries],
        cell_end_release=current.cell_end_release,
        counter=current.counter,
        cache_bytes=current.cache_bytes,
    )
    return facts


def _import_look_alikes(errors: dict[str, str | None]) -> None:
    """Import the patched module of every installed look-alike library, so the fix decides on it."""
    from importlib.util import find_spec

    for target in TARGETS:
        if target is BITSANDBYTES:
            continue
        try:
            if find_spec(target.name) is None:
                continue
        except (Exception, SystemExit) as error:
            errors[target.name] = failure(target.name, error)
            continue
        module, problem = try_import(target.module)
        if module is None:
            errors[target.name] = problem


def _print_json(payload: dict[str, Any]) -> None:
    """The one JSON style of every command: one object on one line, keys sorted."""
    print(json.dumps(payload, sort_keys=True))


_VIA = {"start-up hook": "the start-up hook", "runner": "bnb-gc-fix run", "import": "import bnb_gc_fix"}


def _cmd_status(args: argparse.Namespace) -> int:
    facts = _facts()
    if args.json:
        _print_json(facts)
        return 0

    def show(value: Any, name: str = "") -> str:
        if value is None and name in facts["import_errors"]:
            installed = distribution_version(name)
            return f"{installed or 'installed'}, fails to import (see why)"
        return "not installed" if value is None else str(value)

    def number(value: int | None) -> str:
        return "- (torch's parametrization module is not imported)" if value is None else str(value)

    state = facts["state"]
    if facts["via"] and state in ("patched", "armed"):
        state += f" (turned on by {_VIA.get(facts['via'], facts['via'])})"
    print(f"bnb-gc-fix {facts['bnb_gc_fix']}")
    print(f"  python         {facts['python']}")
    if not facts["gil"]:
        print("  free-threaded: the GIL is off; the fix's locked gate is untested on such a build")
    print(f"  torch          {show(facts['torch'], 'torch')}")
    print(f"  bitsandbytes   {show(facts['bitsandbytes'], 'bitsandbytes')}")
    print(f"  transformers   {show(facts['transformers'])}")
    print(f"state:           {state}")
    if not (facts["verdict"] and facts["reason"].startswith(facts["verdict"])):
        print(f"  why:           {facts['reason']}")  # only when it says more than "affected" below
    affected = {True: "yes", False: "no", None: "no (nothing to judge)"}[facts["affected"]]
    print(f"affected:        {affected}")
    print(f"  why:           {facts['verdict']}")
    print(f"cache counter:   {number(facts['counter'])}")
    print(f"cache bytes:     {number(facts['cache_bytes'])}")
    hook = "installed" if facts["startup_hook"] else "not installed"
    if facts["startup_hook_switched_off"]:
        hook += f", switched off by {boot.VARIABLE}"
    print(f"start-up hook:   {hook}")
    switch = "unset" if facts["switch"] is None else facts["switch"]
    print(f"{boot.VARIABLE}:      {switch} (mode {facts['mode']})")
    release = "installed" if facts["cell_end_release"] else "not installed (IPython/Jupyter only)"
    print(f"cell-end release: {release}")
    print("libraries:")
    for library in facts["libraries"]:
        affected = {True: "yes", False: "no", None: "not known"}[library["affected"]]
        print(
            f"  {library['name']:<14} {show(library['version'])}: affected {affected}, "
            f"{'patched' if library['patched'] else 'not patched'}"
        )
        if library["name"] != "bitsandbytes":  # its sentence is printed above
            print(f"    why:         {library['reason']}")
    look_alikes = {
        n: p
        for n, p in facts["import_errors"].items()
        if n in {t.name for t in TARGETS if t is not BITSANDBYTES}
    }
    for name, problem in look_alikes.items():
        print(f"  {name:<14} {problem}")
    if not facts["libraries"] and not look_alikes:
        print("  none imported")
    return 0


EXIT_PROTECTED, EXIT_LEAK, EXIT_CANNOT_RUN = 0, 1, 2
EXIT_USAGE = 2


def _cmd_check(args: argparse.Namespace) -> int:
    """Every path ends with 0, 1 or 2 and, with --json, exactly one JSON object on stdout."""
    from bnb_gc_fix import check

    try:
        result = check.run(device=args.device, steps=args.steps)
        error = None
    except check.CannotRunError as cannot:
        result, error = None, str(cannot)
    except Exception as unexpected:  # a bug of ours must not read as "leak observed"
        result, error = None, f"the check itself failed ({type(unexpected).__name__}: {unexpected})"
    current = fix_status()
    if result is None:
        code = EXIT_CANNOT_RUN
    else:
        code = EXIT_PROTECTED if result.protected else EXIT_LEAK
    args.exit_code = code  # what main() returns even if stdout is closed while printing
    if args.json:
        payload: dict[str, Any] = {"device": args.device, "protected": None, "steps": []}
        if result is not None:
            payload.update(result.as_dict())
        payload.update(
            error=error,
            exit_code=code,
            bitsandbytes=current.bitsandbytes,
            torch=current.torch,
            active=current.active,
            state=current.state,
            reason=current.reason,
        )
        _print_json(payload)
        return code
    if result is None:
        print(f"bnb-gc-fix check: cannot run: {error}", file=sys.stderr)
        return code
    print(
        f"bnb-gc-fix check: bitsandbytes {current.bitsandbytes}, torch {current.torch}, "
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


def _cmd_run(args: argparse.Namespace) -> int:
    from bnb_gc_fix import runner

    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    return runner.run(command)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bnb-gc-fix",
        description="Diagnose and stop bitsandbytes' 4-bit parametrization cache leak.",
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
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors reach :func:`main` (to answer in JSON under ``--json``)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _usage_error(error: _UsageError, argv: Sequence[str]) -> int:
    if "--json" in argv:
        payload: dict[str, Any] = {"error": f"{error.parser.prog}: {error.message}", "exit_code": EXIT_USAGE}
        if "check" in argv:
            payload.update(device=None, protected=None, steps=[])
        _print_json(payload)
    else:
        error.parser.print_usage(sys.stderr)
        print(f"{error.parser.prog}: error: {error.message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
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


if __name__ == "__main__":
    raise SystemExit(main())
