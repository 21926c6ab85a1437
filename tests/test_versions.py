"""What bnb-gc-fix does on each bitsandbytes and transformers release, in the environment it runs in.

The version matrix's cells (cells.toml, run by noxfile.py) install one combination each and run these
tests (``pytest -m matrix``); what is expected comes from the installed versions:

* no bitsandbytes: ``import bnb_gc_fix`` is clean, bitsandbytes stays absent, status says why;
* bitsandbytes before the affected range (no ``bitsandbytes.nn.parametrize``): nothing to do, and status
  says why;
* in the affected range: patched, the counter is 0 after every step, and the control (``BNB_GC_FIX=0``)
  leaks;
* from the first fixed release on (upstream's fix): the package steps aside, the counter is 0 with and
  without it;
* transformers 4.x: a tiny Llama whose 2-D Linear weights are quantized, trained once with
  ``use_reentrant=False`` (leaks where affected) and once with 4.x's default reentrant checkpointing
  (never leaks); transformers 5: the tiny OLMoE of the bug report (fused 3-D experts).

The affected range is the package's own (``_bnb_gc_fix``: ``first_affected``, ``first_fixed``,
read by conftest in a fresh interpreter), never typed here.

The status is read from ``bnb-gc-fix status --json`` (keys ``state``, ``asked_by``, ``fixed``, ``reason``,
``libraries[]``) and from the scenarios' own summary line (``state``, ``reason``, ``asked_by``).
"""

from __future__ import annotations

import json
import os
import textwrap
from functools import cache
from typing import Any

import pytest
from conftest import (
    BITSANDBYTES,
    FIRST_AFFECTED,
    FIRST_FIXED,
    ROOT,
    SCENARIOS,
    TORCH,
    TRANSFORMERS,
    command,
    run_code,
    run_python,
)
from packaging.version import Version

CELL = os.environ.get("BNB_GC_FIX_CELL")  # set by noxfile.py in every cell
STEPS = 3


def _kind() -> str:
    if BITSANDBYTES is None:
        return "no-bitsandbytes"
    # The range as the package states it (_bnb_gc_fix); a pre-release counts as its release.
    version = Version(Version(BITSANDBYTES).base_version)
    if version < Version(FIRST_AFFECTED):
        return "no-parametrize"
    return "affected" if version < Version(FIRST_FIXED) else "fixed-upstream"


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==", 1) for line in lines if "==" in line and not line.startswith("#"))


KIND = _kind()
TRAINS = KIND in ("affected", "fixed-upstream")
TRANSFORMERS_4 = TRANSFORMERS is not None and Version(TRANSFORMERS) < Version("5")
CHECKPOINTING = ["non-reentrant", "default"] if TRANSFORMERS_4 else ["non-reentrant"]
# The main suite's own stack: test_hooks.py's tiny OLMoE fix/control tests and test_command_line.py's status
# tests prove the same there, so the matrix's copy runs only in its nox cell (bnb-0.49.2).
_PINS = _pins()
REFERENCE = (
    CELL is None
    and BITSANDBYTES == _PINS.get("bitsandbytes")
    and TRANSFORMERS == _PINS.get("transformers")
    and str(TORCH).split("+")[0] == _PINS.get("torch")
)

pytestmark = [
    pytest.mark.matrix,
    pytest.mark.usefixtures("startup_hook_installed"),
    pytest.mark.skipif(
        REFERENCE,
        reason="reference stack: test_hooks.py::test_tiny_olmoe_with_fix_ends_every_step_at_zero, "
        "::test_tiny_olmoe_control_leaks_without_fix and test_command_line.py::test_status_command_and_"
        "its_json_on_this_stack prove the same here; the matrix runs this file in its cells (nox)",
    ),
]
trains = pytest.mark.skipif(not TRAINS, reason=f"{KIND}: nothing to train against")
probes = pytest.mark.skipif(TRAINS, reason=f"{KIND}: the training tests cover this release")


@cache
def scenario(checkpointing: str, switch: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One training run in a process of its own: its per-step records and its summary."""
    common = ["--steps", str(STEPS), "--layers", "2", "--import-fix"]
    if TRANSFORMERS_4:
        argv = [str(SCENARIOS / "tiny_llama_linear.py"), *common, "--checkpointing", checkpointing]
    else:
        argv = [str(SCENARIOS / "tiny_olmoe.py"), *common]
    run = run_python(argv, switch=switch, timeout=600)
    assert run.returncode == 0, f"{argv} failed:\n{run.stdout}\n{run.stderr}"
    assert len(run.steps) == STEPS, run.stdout
    assert run.summary.get("error") is None, run.summary
    return run.steps, run.summary


#: What status says of a release whose hooks do not leak this way (upstream's fix).
SWITCHED_OFF = "hooks switch the cache off even when a forward raises: nothing to fix"


def status_json() -> dict[str, Any]:
    code, out, err = command("status", "--json")
    assert code == 0, err
    facts: dict[str, Any] = json.loads(out)
    return facts


def bitsandbytes_entry(facts: dict[str, Any]) -> dict[str, Any]:
    return next((lib for lib in facts.get("libraries", []) if lib.get("name") == "bitsandbytes"), {})


@trains
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_with_the_fix_the_counter_is_zero_after_every_step(checkpointing: str, record_property: Any) -> None:
    steps, summary = scenario(checkpointing, None)
    counters = [s["counter"] for s in steps]
    for key, value in (("counters", counters), ("state", summary.get("state")), ("kind", KIND)):
        record_property(key, json.dumps(value))
    record_property("matrix", json.dumps("fix"))  # the matrix cells' rows in docs/matrix.md
    record_property("use_reentrant", json.dumps(summary.get("use_reentrant")))
    assert counters == [0] * STEPS and steps[-1]["cache_bytes"] == 0, steps
    if KIND == "affected":
        assert summary["state"] == "protected", summary
    else:  # upstream's fix: the package steps aside and says why
        assert summary["state"] == "not affected" and SWITCHED_OFF in summary["reason"], summary
    if checkpointing == "default":  # transformers 4.x's default is reentrant checkpointing
        assert summary["use_reentrant"] is True, summary
    elif TRANSFORMERS_4:
        assert summary["use_reentrant"] is False, summary


@trains
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_control_leaks_only_on_an_affected_release(checkpointing: str, record_property: Any) -> None:
    steps, summary = scenario(checkpointing, "0")
    counters = [s["counter"] for s in steps]
    record_property("counters", json.dumps(counters))
    record_property("kind", json.dumps(KIND))
    record_property("matrix", json.dumps("control"))
    assert summary["asked_by"] is None, summary
    if KIND == "affected" and checkpointing == "non-reentrant":
        assert counters[0] > 0 and all(b > a for a, b in zip(counters, counters[1:])), counters
        assert steps[-1]["cache_bytes"] > 0
    else:  # upstream's fix, or reentrant checkpointing: nothing leaks even without the package
        assert counters == [0] * STEPS and steps[-1]["cache_bytes"] == 0, steps


@trains
def test_status_json_says_whether_this_release_is_affected(record_property: Any) -> None:
    facts = status_json()
    library = bitsandbytes_entry(facts)
    record_property("state", json.dumps(facts["state"]))
    assert library.get("version") == BITSANDBYTES
    assert facts["process"]["counter"] == 0  # the command's own process: nothing quantized there
    assert library.get("hooks") == ("leak this way" if KIND == "affected" else "do not leak this way"), (
        library
    )
    assert facts["asked_by"] is not None, facts  # asked for; in the hooks only where they leak
    assert facts["fixed"] is library.get("fixed") is (KIND == "affected"), facts
    if KIND == "affected":  # what a job here gets (issue 51), in status()'s words (issue 54)
        assert facts["state"] == "protected", facts
        job = "the fix covers the modules a job here quantizes with replace_parameter_4bit"
        assert facts["reason"] == job, facts
    else:
        assert facts["state"] == "not affected", facts
        assert SWITCHED_OFF in facts["reason"], facts


# Public API only: what a user on this release sees.
PROBE = textwrap.dedent(
    """
    import importlib.metadata, importlib.util, json, sys, warnings
    out = {"find_spec": importlib.util.find_spec("bitsandbytes") is not None}
    try:
        out["distribution"] = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        out["distribution"] = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import bnb_gc_fix
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    try:
        import bitsandbytes
        out["bitsandbytes"] = "ok " + str(getattr(bitsandbytes, "__version__", "?"))
    except ImportError as error:
        out["bitsandbytes"] = type(error).__name__
    out["state"] = bnb_gc_fix.status().state
    print(json.dumps(out))
    """
)


@probes
def test_import_is_clean_and_the_fix_stays_off(record_property: Any) -> None:
    probe = run_code(PROBE).last_json
    record_property("kind", json.dumps(KIND))
    assert probe["warnings"] == [] and probe["state"] == "not affected", probe
    if KIND == "no-bitsandbytes":  # a real absence: neither importable nor known to importlib.metadata
        assert probe["find_spec"] is False and probe["distribution"] is None, probe
        assert probe["bitsandbytes"] == "ModuleNotFoundError", probe
    else:
        assert probe["bitsandbytes"] == f"ok {BITSANDBYTES}", probe


@probes
def test_status_json_says_why_nothing_needs_the_fix() -> None:
    facts = status_json()
    assert facts["state"] == "not affected" and facts["process"]["covered"] == 0, facts
    assert facts["import_errors"] == [], facts
    if KIND == "no-bitsandbytes":
        assert bitsandbytes_entry(facts)["version"] is None and facts["bitsandbytes"] is None, facts
        assert facts["reason"] == "bitsandbytes cannot be imported here, so no job here quantizes with it"
    else:
        assert bitsandbytes_entry(facts)["version"] == BITSANDBYTES, facts
        assert f"bitsandbytes {BITSANDBYTES} has no bitsandbytes.nn.parametrize" in facts["reason"], facts


@probes
def test_check_exits_2_cannot_run_here() -> None:
    code, out, err = command("check", "--json")
    assert code == 2, (out, err)
    assert json.loads(out)["exit_code"] == 2


def test_the_cell_runs_what_cells_toml_asks_for() -> None:
    """In a nox cell: the versions installed are the cell's (a resolver never swapped one)."""
    if CELL is None:
        pytest.skip("outside a nox cell: nothing asked for")
    import tomllib

    cell = next(c for c in tomllib.loads((ROOT / "cells.toml").read_text())["cells"] if c["name"] == CELL)
    for installed, asked in (
        (BITSANDBYTES, "bitsandbytes"),
        (TRANSFORMERS, "transformers"),
        (TORCH, "torch"),
    ):
        if cell[asked] == "*":  # the newest release, whichever it is today: installed, at least
            assert installed is not None, asked
        else:
            assert (installed or "") == cell[asked], asked
