"""The ``bnb-gc-fix`` command line: ``status``, ``check`` and ``run``."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import _bnb_gc_fix_boot as boot
from bnb_gc_fix import __version__, decide
from bnb_gc_fix.activation import gil_enabled
from bnb_gc_fix.activation import status as fix_status


def _distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _facts() -> dict[str, Any]:
    """Everything ``status`` reports, gathered once (imports torch and bitsandbytes if present)."""
    watcher = boot.installed_watcher()
    facts: dict[str, Any] = {
        "bnb_gc_fix": __version__,
        "python": platform.python_version(),
        "gil": gil_enabled(),  # False: free-threaded build without the GIL (an untested path)
        "torch": None,
        "bitsandbytes": None,
        "transformers": _distribution_version("transformers"),
        "switch": None,
        "mode": boot.mode(),
        "startup_hook": watcher is not None or boot.trigger is not None,
        "in_affected_range": None,
        "probe": None,
        "affected": None,
        "verdict": None,
    }
    try:
        import torch

        facts["torch"] = str(torch.__version__)
    except ImportError:
        facts["verdict"] = "torch is not installed; nothing to patch"
    parametrize: ModuleType | None = None
    if facts["torch"] is not None:
        try:
            import bitsandbytes

            facts["bitsandbytes"] = str(getattr(bitsandbytes, "__version__", "unknown"))
            parametrize = importlib.import_module("bitsandbytes.nn.parametrize")
        except ImportError as error:
            if facts["bitsandbytes"] is None:
                facts["verdict"] = f"bitsandbytes is not installed ({error}); nothing to patch"
            else:
                facts["verdict"] = f"{decide.no_parametrize(facts['bitsandbytes'])}; nothing to patch"
    facts["in_affected_range"] = decide.in_affected_range(facts["bitsandbytes"])
    if parametrize is not None:
        verdict = decide.judge(parametrize, force=boot.mode() == boot.FORCE)
        facts["probe"] = verdict.probe
        facts["affected"] = verdict.affected
        facts["verdict"] = verdict.reason
    current = fix_status()
    facts.update(
        active=current.active,
        reason=current.reason,
        via=current.via,
        switch=current.switch,
    )
    return facts


def _cmd_status(args: argparse.Namespace) -> int:
    facts = _facts()
    if args.json:
        print(json.dumps(facts, indent=2, sort_keys=True))
        return 0

    def show(value: Any) -> str:
        return "not installed" if value is None else str(value)

    print(f"bnb-gc-fix {facts['bnb_gc_fix']}")
    print(f"  python         {facts['python']}")
    if not facts["gil"]:
        print("  free-threaded: the GIL is off; the fix's locked gate is untested on such a build")
    print(f"  torch          {show(facts['torch'])}")
    print(f"  bitsandbytes   {show(facts['bitsandbytes'])}")
    print(f"  transformers   {show(facts['transformers'])}")
    affected = {True: "yes", False: "no", None: "no (nothing to judge)"}[facts["affected"]]
    print(f"affected:        {affected}")
    print(f"  why:           {facts['verdict']}")
    print(f"fix active:      {'yes' if facts['active'] else 'no'}")
    print(f"  why:           {facts['reason']}")
    print(f"  turned on by:  {facts['via'] or '-'}")
    print(f"  start-up hook: {'installed' if facts['startup_hook'] else 'not installed'}")
    switch = "unset" if facts["switch"] is None else facts["switch"]
    print(f"  {boot.VARIABLE}:    {switch} (mode {facts['mode']})")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from bnb_gc_fix import check

    try:
        result = check.run(device=args.device, steps=args.steps)
    except check.CannotRunError as error:
        if args.json:
            print(json.dumps({"error": str(error), "protected": None, "steps": []}))
        else:
            print(f"bnb-gc-fix check: cannot run: {error}", file=sys.stderr)
        return 2
    current = fix_status()
    if args.json:
        payload = result.as_dict() | {
            "bitsandbytes": current.bitsandbytes,
            "torch": current.torch,
            "active": current.active,
            "reason": current.reason,
        }
        print(json.dumps(payload))
    else:
        print(
            f"bnb-gc-fix check: bitsandbytes {current.bitsandbytes}, torch {current.torch}, "
            f"device {result.device}, fix {'active' if current.active else 'not active'}"
        )
        print(f"{'step':>4}  {'counter':>7}  {'cache bytes':>11}")
        for step in result.steps:
            print(f"{step.step:>4}  {step.counter:>7}  {step.cache_bytes:>11}")
        if result.protected:
            print("protected: the counter and the cache were back to zero after every step")
        else:
            state = "active" if current.active else "not active"
            print(
                "LEAK: the parametrization cache stayed switched on after a step, so dequantized weights "
                f"stay resident. The fix is {state} here: {current.reason}."
            )
    return 0 if result.protected else 1


def _cmd_run(args: argparse.Namespace) -> int:
    from bnb_gc_fix import runner

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return runner.run(command)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bnb-gc-fix",
        description="Diagnose and stop bitsandbytes' 4-bit parametrization cache leak.",
    )
    parser.add_argument("--version", action="version", version=f"bnb-gc-fix {__version__}")
    commands = parser.add_subparsers(dest="command_name", required=True)

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
    run.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    run.set_defaults(func=_cmd_run)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
