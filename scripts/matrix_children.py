"""The matrix's child interpreters: their environment, running them, reading what they printed."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from matrix_cells import REPO, SWITCH
from matrix_setup import log

CHILD_TIMEOUT = 600


@dataclasses.dataclass
class Job:
    key: str
    argv: list[str]
    python: str
    paths: list[Path]
    switch: str | None  # None: BNB_GC_FIX unset
    result: dict[str, Any] | None = None


def child_env(job: Job, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(SWITCH, None)
    if job.switch is not None:
        env[SWITCH] = job.switch
    inherited = [] if job.python != sys.executable else [p for p in [env.get("PYTHONPATH")] if p]
    path = [str(p) for p in job.paths] + inherited
    if path:
        env["PYTHONPATH"] = os.pathsep.join(path)
    else:
        env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    return env


def _relative(arg: str) -> str:
    prefix = str(REPO) + os.sep
    return arg[len(prefix) :] if arg.startswith(prefix) else arg


def run_job(job: Job, threads: int) -> dict[str, Any]:
    started = time.monotonic()
    try:
        done = subprocess.run(
            [job.python, *job.argv],
            capture_output=True,
            text=True,
            env=child_env(job, threads),
            cwd=str(REPO),
            timeout=CHILD_TIMEOUT,
            check=False,
        )
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as error:
        rc, stdout, stderr = -1, str(error.stdout or ""), f"timed out after {CHILD_TIMEOUT}s"
    seconds = round(time.monotonic() - started, 1)
    lines = parse_json(stdout)
    shown = " ".join(shlex.quote(_relative(a)) if len(a) < 200 else "<probe code>" for a in job.argv)
    log(f"{job.key}: rc={rc} in {seconds}s ({SWITCH}={job.switch if job.switch is not None else 'unset'})")
    return {
        "key": job.key,
        "command": f"{SWITCH}={job.switch} " * (job.switch is not None) + f"python {shown}",
        "pythonpath": [str(p.relative_to(REPO)) if REPO in p.parents else str(p) for p in job.paths],
        "rc": rc,
        "seconds": seconds,
        "json": lines,
        "stdout_tail": stdout[-1500:],
        "stderr_tail": stderr[-2500:],
    }


def parse_json(stdout: str) -> list[Any]:
    """The JSON values a child printed: the whole output if it is one (indented) value, else per line."""
    try:
        return [json.loads(stdout)]
    except json.JSONDecodeError:
        pass
    values: list[Any] = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                values.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return values


def last_object(result: dict[str, Any]) -> dict[str, Any] | None:
    objects = [x for x in result["json"] if isinstance(x, dict)]
    return objects[-1] if objects else None


def training_run(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """Summarise a scenario run: counters per step, final cache bytes, the fix's own summary."""
    records = [x for x in result["json"] if isinstance(x, dict) and "step" in x]
    summary = next((x["summary"] for x in result["json"] if isinstance(x, dict) and "summary" in x), {})
    wrapper = next((x for x in result["json"] if isinstance(x, dict) and "versions" in x), {})
    status = wrapper.get("status") or {}
    versions = wrapper.get("versions") or {}
    counters = [int(r["counter"]) for r in records if "counter" in r]
    cache = [int(r["cache_bytes"]) for r in records if "cache_bytes" in r]
    problems = []
    if result["rc"] != 0:
        problems.append(f"exit status {result['rc']}")
    if summary.get("error") or any("error" in r for r in records):
        problems.append(f"training error: {summary.get('error')}")
    if len(counters) != steps:
        problems.append(f"{len(counters)} of {steps} steps reported")
    if not wrapper:
        problems.append("no status line from with_status.py")
    return {
        "counters": counters,
        "max_counter": max(counters) if counters else None,
        "final_cache_bytes": cache[-1] if cache else None,
        "cache_bytes": cache,
        "active": status.get("active"),
        "affected": status.get("affected"),
        "via": status.get("via"),
        "reason": status.get("reason"),
        "probe": status.get("probe"),
        "status": status,
        "bitsandbytes": versions.get("bitsandbytes"),
        "transformers": versions.get("transformers"),
        "use_reentrant": summary.get("use_reentrant"),
        "problems": problems,
        "seconds": result["seconds"],
        "command": result["command"],
    }
