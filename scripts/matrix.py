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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OLMOE = REPO / "tests" / "scenarios" / "tiny_olmoe.py"
LLAMA = REPO / "scripts" / "scenarios" / "tiny_llama_linear.py"
WITH_STATUS = REPO / "scripts" / "scenarios" / "with_status.py"
CONSTRAINTS = REPO / "constraints.txt"
SWITCH = "BNB_GC_FIX"
TF4_SPEC = "transformers==4.57.6"
CHILD_TIMEOUT = 600
MARKER = ".matrix-ok"  # written last into a --target dir: its install completed

# Expectation kinds.
NONE = "no-bitsandbytes"  # bitsandbytes not installed: import cleanly, say so
NO_PARAMETRIZE = "no-parametrize"  # < 0.48: nothing to do, status says why
AFFECTED = "affected"  # 0.48-0.49: patched, leak gone, control leaks
FIXED = "fixed-upstream"  # >= 0.50: steps aside, upstream's fix holds with and without us
NO_LEAK = "no-leak"  # reentrant checkpointing: nothing leaks even in the control

EXPECTATIONS = {
    NONE: "imports cleanly; status: bitsandbytes not installed, inactive; check exits 2",
    NO_PARAMETRIZE: "inactive, status says why; check exits 2",
    AFFECTED: "patched; fix: counter 0 every step; control leaks",
    FIXED: "steps aside (inactive, reason); counter 0 every step, unset and =0",
    NO_LEAK: "no leak in fix or control (reentrant checkpointing)",
}


@dataclasses.dataclass(frozen=True)
class Cell:
    name: str
    bnb: str | None  # None: no bitsandbytes at all
    kind: str
    transformers: str = "installed"  # "installed" or "4.57"
    scenario: str = "olmoe"  # "olmoe" (fused 3-D experts) or "llama-linear" (2-D Linear weights)
    checkpointing: str = "non-reentrant"  # for llama-linear: non-reentrant | default
    note: str = ""


CELLS = [
    Cell("no-bnb", None, NONE, note="bitsandbytes not installed (venv without it)"),
    Cell("bnb-0.47.0", "0.47.0", NO_PARAMETRIZE, note="no bitsandbytes.nn.parametrize yet"),
    Cell("bnb-0.48.0", "0.48.0", AFFECTED),
    Cell("bnb-0.48.2", "0.48.2", AFFECTED),
    Cell("bnb-0.49.0", "0.49.0", AFFECTED),
    Cell("bnb-0.49.2", "0.49.2", AFFECTED),
    Cell("bnb-0.50.0", "0.50.0", FIXED, note="upstream fix (always_call)"),
    Cell("bnb-0.50.2", "0.50.2", FIXED, note="upstream fix (always_call)"),
    Cell(
        "bnb-0.49.2+tf4.57",
        "0.49.2",
        AFFECTED,
        transformers="4.57",
        scenario="llama-linear",
        note="2-D Linear weights, use_reentrant=False",
    ),
    Cell(
        "bnb-0.49.2+tf4.57-default",
        "0.49.2",
        NO_LEAK,
        transformers="4.57",
        scenario="llama-linear",
        checkpointing="default",
        note="2-D Linear weights, 4.57 default use_reentrant=True",
    ),
]

# Runs inside the "no bitsandbytes" interpreter and the < 0.48 one: public API only.
PROBE = r"""
import dataclasses, importlib.metadata, importlib.util, json, sys, warnings
out = {"find_spec": importlib.util.find_spec("bitsandbytes") is not None}
try:
    out["distribution"] = importlib.metadata.version("bitsandbytes")
except importlib.metadata.PackageNotFoundError:
    out["distribution"] = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        import bnb_gc_fix
        out["import_error"] = None
    except Exception as error:
        out["import_error"] = f"{type(error).__name__}: {error}"
out["import_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
out["torch_imported_by_import"] = "torch" in sys.modules
if out["import_error"] is None:
    out["status_before"] = dataclasses.asdict(bnb_gc_fix.status())
    try:
        import bitsandbytes
        out["bitsandbytes_import"] = "ok " + str(getattr(bitsandbytes, "__version__", "?"))
    except ImportError as error:
        out["bitsandbytes_import"] = f"{type(error).__name__}: {error}"
    out["status_after"] = dataclasses.asdict(bnb_gc_fix.status())
print(json.dumps(out))
"""


def log(message: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class SetupError(Exception):
    """The matrix cannot run (an install failed, the package is missing, ...)."""


# --------------------------------------------------------------------------- installs


def pip(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise SetupError(f"{shlex.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return result


def torch_constraint(cache: Path) -> Path:
    """A constraints file that pins torch only (the repo's pin, else the installed version)."""
    line = None
    if CONSTRAINTS.exists():
        for raw in CONSTRAINTS.read_text().splitlines():
            if re.match(r"^\s*torch\s*==", raw):
                line = raw.strip()
    if line is None:
        from importlib import metadata

        try:
            line = "torch==" + metadata.version("torch").split("+")[0]
        except metadata.PackageNotFoundError:
            raise SetupError("torch is not installed in this interpreter")
    path = cache / "torch-constraint.txt"
    path.write_text(line + "\n")
    return path


def _complete(target: Path, distribution: str, version: str) -> bool:
    return (target / MARKER).exists() and (target / f"{distribution}-{version}.dist-info").is_dir()


def install_target(target: Path, requirements: list[str], refresh: bool) -> Path:
    """``pip install --no-deps --target``, atomically: a half-finished install never counts.

    pip byte-compiles what it installs, so children (often run with PYTHONDONTWRITEBYTECODE)
    do not recompile transformers on every start.
    """
    if (target / MARKER).exists() and not refresh:
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    log(f"installing {' '.join(requirements)} into {target}")
    pip("install", "--quiet", "--no-deps", "--target", str(staging), *requirements)
    (staging / MARKER).write_text("\n".join(requirements) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def install_bnb(cache: Path, version: str, refresh: bool) -> Path:
    target = cache / f"bnb-{version}"
    install_target(target, [f"bitsandbytes=={version}"], refresh)
    if not _complete(target, "bitsandbytes", version):
        raise SetupError(f"{target} does not hold bitsandbytes {version}")
    return target


def install_transformers4(cache: Path, spec: str, refresh: bool) -> Path:
    """transformers 4.57.x plus whichever of its dependencies the environment does not satisfy."""
    existing = sorted(cache.glob("transformers-4.*[0-9]"))
    if existing and not refresh and (existing[-1] / MARKER).exists():
        return existing[-1]
    constraint = torch_constraint(cache)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--quiet", "--report", str(report), "-c", str(constraint), spec)
        plan = json.loads(report.read_text())
    pins = [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in plan["install"]]
    names = {pin.split("==")[0].lower().replace("_", "-") for pin in pins}
    if "torch" in names:
        raise SetupError(f"installing {spec} would change torch: {pins}")
    version = next(pin.split("==")[1] for pin in pins if pin.lower().startswith("transformers=="))
    target = cache / f"transformers-{version}"
    install_target(target, pins, refresh=True)
    for stale in existing:
        if stale != target:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def site_dirs() -> list[Path]:
    dirs = [Path(p) for p in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(Path(site.getusersitepackages()))
    for key in ("purelib", "platlib"):
        dirs.append(Path(sysconfig.get_paths()[key]))
    unique: list[Path] = []
    for path in dirs:
        if path.is_dir() and path.resolve() not in [u.resolve() for u in unique]:
            unique.append(path)
    return unique


def make_no_bnb_python(cache: Path) -> Path:
    """A fresh venv mirroring this interpreter's site-packages by symlinks, minus bitsandbytes.

    Only ever writes inside ``<cache>/no-bnb-venv``: the site-packages folder is asked of the
    venv's own interpreter *with* ``site`` (``python -S`` would answer the base interpreter's) and
    refused unless it lies inside the venv, and only symlinks are ever removed from it.
    """
    root = (cache / "no-bnb-venv").resolve()
    bindir = "Scripts" if os.name == "nt" else "bin"
    python = root / bindir / ("python.exe" if os.name == "nt" else "python")
    if not python.exists():
        log(f"creating {root}")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    asked = subprocess.run(
        [
            str(python),
            "-I",
            "-c",
            "import sys, sysconfig; print(sys.prefix); print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    prefix, target = Path(asked[0].strip()).resolve(), Path(asked[1].strip()).resolve()
    if prefix != root or root not in target.parents:
        raise SetupError(f"the venv at {root} reports prefix {prefix} and site-packages {target}; refusing")
    target.mkdir(parents=True, exist_ok=True)
    for entry in target.iterdir():  # rebuild every run: mirror the environment as it is now
        if not entry.is_symlink():
            raise SetupError(f"{entry} is not one of our symlinks; remove {root} by hand")
        entry.unlink()
    linked: set[str] = set()
    for directory in site_dirs():
        if directory.resolve() == target:
            continue
        for entry in sorted(directory.iterdir()):
            if entry.name.lower().startswith("bitsandbytes") or entry.name in linked:
                continue
            linked.add(entry.name)
            (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return python


# --------------------------------------------------------------------------- children


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


# --------------------------------------------------------------------------- the matrix


class Matrix:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache: Path = args.cache_dir
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()

    def job(self, key: str, argv: list[str], paths: list[Path], switch: str | None, python: str) -> str:
        with self.lock:
            if key not in self.jobs:
                self.jobs[key] = Job(key, argv, python, paths, switch)
        return key

    def scenario_argv(self, cell: Cell) -> list[str]:
        common = ["--steps", str(self.args.steps), "--layers", str(self.args.layers), "--import-fix"]
        if cell.scenario == "olmoe":
            return [str(WITH_STATUS), str(OLMOE), *common]
        return [str(WITH_STATUS), str(LLAMA), *common, "--checkpointing", cell.checkpointing]

    def plan(self, cell: Cell, paths: dict[str, Path], no_bnb_python: str | None) -> dict[str, str]:
        """The children a cell needs, as role -> job key (jobs shared between cells run once)."""
        python = sys.executable
        if cell.bnb is None:
            assert no_bnb_python is not None
            env = "no-bnb"
            python, where = no_bnb_python, []
        else:
            where = [paths[f"bnb-{cell.bnb}"]]
            env = f"bnb-{cell.bnb}"
            if cell.transformers != "installed":
                where.append(paths["tf4"])
                env += f"+tf{cell.transformers}"
        if cell.kind in (NONE, NO_PARAMETRIZE):
            cli = ["-m", "bnb_gc_fix"]
            return {
                "probe": self.job(f"{env}:probe", ["-c", PROBE], where, None, python),
                "status": self.job(f"{env}:status", [*cli, "status", "--json"], where, None, python),
                "check": self.job(f"{env}:check", [*cli, "check", "--json"], where, None, python),
            }
        argv = self.scenario_argv(cell)
        tag = f"{env}:{cell.scenario}:{cell.checkpointing}"
        return {
            "fix": self.job(f"{tag}:fix", argv, where, None, python),
            "control": self.job(f"{tag}:control", argv, where, "0", python),
        }

    def prepare(self, cells: list[Cell]) -> tuple[dict[str, Path], str | None]:
        self.cache.mkdir(parents=True, exist_ok=True)
        ignore = self.cache / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# created by scripts/matrix.py: nothing in here belongs in git\n*\n")
        paths: dict[str, Path] = {}
        wanted = sorted({c.bnb for c in cells if c.bnb is not None})
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
            futures = {v: pool.submit(install_bnb, self.cache, v, self.args.refresh) for v in wanted}
            tf4 = None
            if any(c.transformers == "4.57" for c in cells):
                tf4 = pool.submit(
                    install_transformers4, self.cache, self.args.transformers4, self.args.refresh
                )
            for version, future in futures.items():
                paths[f"bnb-{version}"] = future.result()
            if tf4 is not None:
                paths["tf4"] = tf4.result()
        no_bnb = None
        if any(c.bnb is None for c in cells):
            no_bnb = str(make_no_bnb_python(self.cache))
        return paths, no_bnb

    def run(self, cells: list[Cell]) -> list[dict[str, Any]]:
        paths, no_bnb = self.prepare(cells)
        plans = {cell.name: self.plan(cell, paths, no_bnb) for cell in cells}
        # Slowest first (transformers 4.57 children import the most), so two workers finish together.
        order = sorted(
            self.jobs.values(), key=lambda j: (":probe" in j.key or ":check" in j.key, "tf" not in j.key)
        )
        threads = max(1, (os.cpu_count() or 1) // self.args.jobs)
        log(f"{len(order)} child interpreters, {self.args.jobs} at a time")
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
            futures = {pool.submit(run_job, job, threads): job for job in order}
            for future in concurrent.futures.as_completed(futures):
                futures[future].result = future.result()
        return [self.judge(cell, plans[cell.name]) for cell in cells]

    def judge(self, cell: Cell, roles: dict[str, str]) -> dict[str, Any]:
        results: dict[str, dict[str, Any]] = {}
        for role, key in roles.items():
            result = self.jobs[key].result
            if result is None:
                raise SetupError(f"child {key} did not run")
            results[role] = result
        row: dict[str, Any] = {
            "cell": cell.name,
            "kind": cell.kind,
            "note": cell.note,
            "expectation": EXPECTATIONS[cell.kind],
            "requested_bitsandbytes": cell.bnb,
            "scenario": cell.scenario if cell.kind not in (NONE, NO_PARAMETRIZE) else None,
            "checkpointing": cell.checkpointing,
            "fix": None,
            "control": None,
            "children": results,
        }
        if cell.kind in (NONE, NO_PARAMETRIZE):
            failures = self.judge_probe(cell, results, row)
        else:
            failures = self.judge_training(cell, results, row)
        if cell.bnb is not None and row["bitsandbytes"] != cell.bnb:
            failures.append(f"expected bitsandbytes {cell.bnb}, the child imported {row['bitsandbytes']}")
        row["failures"] = failures
        row["verdict"] = "PASS" if not failures else "FAIL"
        return row

    def judge_probe(self, cell: Cell, results: dict[str, dict[str, Any]], row: dict[str, Any]) -> list[str]:
        """No bitsandbytes, or one without bitsandbytes.nn.parametrize: nothing to do, and say why."""
        failures: list[str] = []
        probe = last_object(results["probe"]) or {}
        cli = last_object(results["status"]) or {}
        check = last_object(results["check"]) or {}
        after = probe.get("status_after") or {}
        row.update(
            bitsandbytes=cli.get("bitsandbytes"),
            transformers=cli.get("transformers"),
            status={k: after.get(k) for k in ("active", "affected", "reason", "probe", "via", "pending")},
            reason=after.get("reason"),
            cli_status=cli,
            probe=probe,
            check=check | {"rc": results["check"]["rc"]},
        )
        if results["status"]["rc"] != 0 or not cli:
            failures.append(f"status --json failed (rc {results['status']['rc']})")
        if results["check"]["rc"] != 2:
            failures.append(f"check exited {results['check']['rc']}, expected 2 (cannot run)")
        if not probe or probe.get("import_error"):
            failures.append(f"import bnb_gc_fix failed: {probe.get('import_error', 'no output')}")
        elif probe.get("import_warnings"):
            failures.append(f"import bnb_gc_fix warned: {probe['import_warnings']}")
        if after.get("active") is not False or cli.get("active") is not False:
            failures.append("the fix reports itself active")
        if cell.kind == NONE:
            if probe.get("find_spec") or probe.get("distribution"):
                failures.append("bitsandbytes is still findable in the no-bitsandbytes interpreter")
            if not str(probe.get("bitsandbytes_import", "")).startswith("ModuleNotFoundError"):
                failures.append(f"import bitsandbytes gave {probe.get('bitsandbytes_import')}")
            if after.get("bitsandbytes") is not None or cli.get("bitsandbytes") is not None:
                failures.append("status names a bitsandbytes version")
            if "not installed" not in str(cli.get("verdict")):
                failures.append(f"status --json verdict does not say not installed: {cli.get('verdict')}")
            if "not installed" not in str(after.get("reason")):
                failures.append(f"status().reason does not say not installed: {after.get('reason')}")
        else:
            reason = str(after.get("reason"))
            if "parametrize" not in reason or str(cell.bnb) not in reason:
                failures.append(f"status().reason does not say why: {reason}")
        return failures

    def judge_training(
        self, cell: Cell, results: dict[str, dict[str, Any]], row: dict[str, Any]
    ) -> list[str]:
        """Fix run and control run of a training scenario."""
        failures: list[str] = []
        fix = training_run(results["fix"], self.args.steps)
        control = training_run(results["control"], self.args.steps)
        status = fix["status"]
        row.update(
            bitsandbytes=fix["bitsandbytes"],
            transformers=fix["transformers"],
            status={k: status.get(k) for k in ("active", "affected", "reason", "probe", "via", "pending")},
            reason=status.get("reason"),
            fix=fix,
            control=control,
        )
        if cell.transformers != "installed" and not str(fix["transformers"]).startswith(cell.transformers):
            failures.append(f"expected transformers {cell.transformers}, got {fix['transformers']}")
        failures += [f"fix run: {p}" for p in fix["problems"]]
        failures += [f"control run: {p}" for p in control["problems"]]
        if control["active"] is not False or "disabled" not in str(control["reason"]):
            failures.append(f"control run was not switched off: {control['reason']}")
        if not fix["counters"] or any(fix["counters"]) or fix["final_cache_bytes"] != 0:
            failures.append(f"fix run leaked: counters {fix['counters']}, cache bytes {fix['cache_bytes']}")
        if cell.kind == AFFECTED:
            if fix["active"] is not True or fix["affected"] is not True:
                failures.append(f"expected active and affected: {fix['reason']}")
            if not control["max_counter"]:
                failures.append(f"control did not leak: counters {control['counters']}")
            return failures
        if cell.kind == FIXED and (fix["active"] is not False or fix["affected"] is not False):
            failures.append(f"expected to step aside (inactive, not affected): {fix['reason']}")
        if cell.kind == NO_LEAK and fix["use_reentrant"] is not True:
            failures.append(f"expected reentrant checkpointing, got use_reentrant={fix['use_reentrant']}")
        if cell.kind == FIXED and not fix["reason"]:
            failures.append("stepped aside without a reason")
        if any(control["counters"]) or control["final_cache_bytes"] != 0:
            failures.append(f"control leaked: counters {control['counters']}")
        return failures


# --------------------------------------------------------------------------- reporting


def _run_cell(run: dict[str, Any] | None) -> str:
    if run is None:
        return "n/a"
    if run["problems"] and run["max_counter"] is None:
        return "error"
    counters = ",".join(str(c) for c in run["counters"])
    return f"max {run['max_counter']} ({counters}); {run['final_cache_bytes']} B"


def _yes_no(value: Any) -> str:
    return {True: "yes", False: "no", None: "-"}.get(value, str(value))


def markdown(rows: list[dict[str, Any]]) -> str:
    header = (
        "| cell | bitsandbytes | transformers | fix active | affected | "
        "fix run (`BNB_GC_FIX` unset): counter per step; final cache | "
        "control (`BNB_GC_FIX=0`) | expectation | verdict |"
    )
    lines = [header, "|" + "---|" * 9]
    for row in rows:
        status = row["status"]
        transformers = row["transformers"] or "-"
        if row["scenario"] == "llama-linear" and row["fix"]:
            transformers += f" ({row['checkpointing']}: use_reentrant={row['fix']['use_reentrant']})"
        lines.append(
            f"| {row['cell']} | {row['bitsandbytes'] or 'not installed'} | {transformers} | "
            f"{_yes_no(status['active'])} | {_yes_no(status['affected'])} | {_run_cell(row['fix'])} | "
            f"{_run_cell(row['control'])} | {row['expectation']} | **{row['verdict']}** |"
        )
    return "\n".join(lines)


def reasons(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        lines.append(f"- **{row['cell']}**: `status().reason`: {row['reason']}")
        if row.get("cli_status"):
            lines.append(f"  - `bnb-gc-fix status --json` verdict: {row['cli_status'].get('verdict')}")
        if row.get("check"):
            lines.append(
                f"  - `bnb-gc-fix check --json`: exit {row['check']['rc']}: {row['check'].get('error')}"
            )
        for failure in row["failures"]:
            lines.append(f"  - FAIL: {failure}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "bnb_gc_fix": version("bnb-gc-fix"),
        "cpu_count": os.cpu_count(),
    }


def document(
    rows: list[dict[str, Any]], env: dict[str, Any], command: str, seconds: float, steps: int
) -> str:
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"""<!-- GENERATED FILE: do not edit. Regenerate with: {command} -->
# bnb-gc-fix version table

Generated by `scripts/matrix.py` on {today} ({seconds:.0f} s); regenerate with `{command}`.
Machine data: [`version-matrix.json`](version-matrix.json).

Environment: Python {env["python"]}, torch {env["torch"]}, bnb-gc-fix {env["bnb_gc_fix"]},
{env["platform"]}, CPU only.

{markdown(rows)}

Columns: *fix active* / *affected* are `bnb_gc_fix.status()` of the fix run's own process (for
`no-bnb` and 0.47, of a probe process after `import bitsandbytes`).
The two runs train for {steps} steps under
non-reentrant activation checkpointing (unless the cell says otherwise) and report torch's
parametrization-cache counter (`torch.nn.utils.parametrize._cache_enabled`) after each step and the
bytes left in its cache at the end; a counter above 0 after a step is the leak.

## How each environment is made

- One interpreter, one torch. Each bitsandbytes release is installed with
  `pip install --no-deps --target <cache>/bnb-X bitsandbytes==X` and put first on `PYTHONPATH`
  (`<cache>`: `--cache-dir`, default `~/.cache/bnb-gc-fix-matrix`).
- bitsandbytes 0.48-0.50 cells train `tests/scenarios/tiny_olmoe.py` (tiny random OLMoE, transformers 5
  fused 3-D experts quantized with `replace_parameter_4bit`).
- transformers 4.57 cells: `pip install --no-deps --target` of the latest 4.57 patch plus the
  dependencies of it the environment does not satisfy (from `pip install --dry-run --report`,
  e.g. `huggingface_hub<1.0`); they train `scripts/scenarios/tiny_llama_linear.py` (tiny random
  Llama whose 2-D `nn.Linear` weights are quantized with `replace_parameter_4bit`).
  `non-reentrant` is
  `gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})`;
  `default` is `gradient_checkpointing_enable()`, which in 4.57 means `use_reentrant=True`.
- `no-bnb`: a fresh `python -m venv --without-pip` whose site-packages symlinks every entry of the
  running interpreter's site-packages except `bitsandbytes*`: bitsandbytes is neither importable nor
  visible to `importlib.metadata`, while bnb-gc-fix and its start-up `.pth` hook are installed as usual.

## Status reasons

{reasons(rows)}
"""


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
