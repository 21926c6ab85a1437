"""Runs the matrix's cells and judges each against its expectation."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import threading
from pathlib import Path
from typing import Any

from matrix_cells import (
    AFFECTED,
    EXPECTATIONS,
    FIXED,
    LLAMA,
    NO_LEAK,
    NO_PARAMETRIZE,
    NONE,
    OLMOE,
    WITH_STATUS,
    Cell,
)
from matrix_children import (
    Job,
    last_object,
    run_job,
    training_run,
)
from matrix_setup import (
    SetupError,
    install_bnb,
    install_transformers4,
    log,
    make_no_bnb_python,
)

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
