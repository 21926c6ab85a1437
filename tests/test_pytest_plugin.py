"""The pytest plugin (``pytest --parametrize-cache-check``) that reports leaking tests.

Each case is a fresh pytest run in pytest's own ``pytester`` (``runpytest_subprocess``), on test files
written here in the shape of the regression tests that upstream projects write; every verdict has its
control beside it (the same file with ``BNB_GC_FIX=0``, or with the check off).
"""

from __future__ import annotations

import ast
import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import SCENARIOS, cache_root, pip_target

pytestmark = [pytest.mark.usefixtures("startup_hook_installed")]
pytest_plugins = ["pytester"]

# In the shape of upstream's checkpointing regression tests: a module quantized with
# replace_parameter_4bit, a non-reentrant checkpointed region whose recompute stops early (the last
# tensor it saves is made inside the quantized forward), and tests that never look at the counter.
UPSTREAM_SHAPE = """
import sys

import pytest
import torch
import torch.nn.utils.parametrize as P
from torch.utils.checkpoint import checkpoint

import quantized


def test_checkpointed_training_step():
    head = torch.nn.Linear(64, 64)
    tail = quantized.make(params=2)
    x = torch.randn(8, 64)
    for _ in range(2):
        y = checkpoint(lambda v: tail(head(v).relu()), x, use_reentrant=False)
        y.pow(2).mean().backward()


def test_after_leak_starts_clean():
    assert P._cache_enabled == 0
    assert P._cache == {}


def test_disable_hook_called_directly():
    from bitsandbytes.nn import parametrize as bnb_parametrize

    bnb_parametrize._disable_parametrization_cache(torch.nn.Identity(), (), None)


def test_after_negative_counter_starts_clean():
    assert P._cache_enabled == 0


def test_cache_held_on_purpose():
    module = quantized.make()
    with P.cached():
        module(torch.randn(2, 64))
        module(torch.randn(2, 64))
        assert P._cache_enabled == 1 and P._cache


@pytest.fixture
def cache_held():
    with P.cached():
        yield


def test_fixture_holds_the_cache(cache_held):
    quantized.make()(torch.randn(2, 64))
    assert P._cache_enabled == 1


def test_plugin_imported_no_bnb_gc_fix():
    import os

    if os.environ.get("BNB_GC_FIX") == "0":  # nothing else imports it then
        assert "bnb_gc_fix" not in sys.modules
"""

AXOLOTL_TRAINING = """
import torch
from torch.utils.checkpoint import checkpoint

import axolotl_moe8bit


def test_train_8bit_experts():
    model = axolotl_moe8bit.build(layers=2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 32)
    for _ in range(2):
        h = x
        for layer in model:
            h = checkpoint(layer, h, use_reentrant=False)
        h.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
"""

# An independent witness for "exactly the tests that leave the counter off zero": a plugin of its own
# that writes torch's counter and cache size after each test's teardown, before the check releases it.
ORACLE = """
import json, os, sys

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    P = sys.modules.get("torch.nn.utils.parametrize")
    if P is not None:
        with open(os.environ["COUNTER_ORACLE"], "a") as out:
            out.write(json.dumps([item.name, P._cache_enabled, len(P._cache)]) + "\\n")
"""

SEEDED = """
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    import torch

    torch.manual_seed(0)
"""

LEAK_LINE = re.compile(r"^LEAK (\S+): P\._cache_enabled = (-?\d+), (\d+) bytes cached$", re.MULTILINE)


@pytest.fixture(scope="session")
def axolotl() -> Path:
    """axolotl 0.19.0, the real wheel as tests/test_axolotl.py installs it (before pytester moves HOME)."""
    return pip_target("axolotl==0.19.0")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:randomly", "-rA", *args, timeout=300
    )


def _witnessed(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    switch: str | None,
    pythonpath: tuple[Path, ...] = (),
) -> pytest.RunResult:
    """A pytester run with ``BNB_GC_FIX`` set to ``switch`` (None: unset), ``pythonpath`` and the
    quantized scenarios importable, and the counter witness loaded (``_off_zero`` reads it)."""
    pytester.makepyfile(counter_oracle=ORACLE)
    if switch is None:
        monkeypatch.delenv("BNB_GC_FIX", raising=False)
    else:
        monkeypatch.setenv("BNB_GC_FIX", switch)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(str(p) for p in [*pythonpath, SCENARIOS]))
    monkeypatch.setenv("COUNTER_ORACLE", str(pytester.path / "oracle.jsonl"))
    return _run(pytester, "-p", "counter_oracle", *args)


def _off_zero(pytester: pytest.Pytester) -> set[str]:
    """The witness's verdict: tests after whose teardown the counter was not 0 or the cache not empty."""
    oracle = pytester.path / "oracle.jsonl"
    records = [json.loads(line) for line in oracle.read_text().splitlines()] if oracle.exists() else []
    return {name for name, counter, cached in records if counter != 0 or cached}


def _leaks(run: pytest.RunResult) -> dict[str, tuple[int, int]]:
    """The summary's LEAK lines: test name -> (counter, bytes)."""
    return {m[1].split("::")[-1]: (int(m[2]), int(m[3])) for m in LEAK_LINE.finditer(run.stdout.str())}


def _outcomes(run: pytest.RunResult, outcome: str) -> set[str]:
    """Names of the tests with ``outcome`` (PASSED, FAILED, ERROR) in the -rA short summary."""
    return set(re.findall(rf"^{outcome} \S+::(\w+)", run.stdout.str(), re.MULTILINE))


# --- flagged without the fix, clean with it: the upstream-shaped file and axolotl's 8-bit experts ----
# One pytest run per switch holds both files (the axolotl one runs first), to keep the suite fast.

LEAKING = {"test_train_8bit_experts", "test_checkpointed_training_step", "test_disable_hook_called_directly"}


def _both_files(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, axolotl: Path, switch: str | None
) -> pytest.RunResult:
    pytester.makepyfile(test_shape=UPSTREAM_SHAPE, test_axolotl_training=AXOLOTL_TRAINING)
    args = ("--parametrize-cache-check",)
    return _witnessed(pytester, monkeypatch, *args, switch=switch, pythonpath=(axolotl,))


@pytest.mark.downloads
@pytest.mark.parametrize("switch", ["0", None], ids=["BNB_GC_FIX=0", "fix-installed-and-on"])
def test_flagged_whether_or_not_the_fix_is_on(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, axolotl: Path, switch: str | None
) -> None:
    run = _both_files(pytester, monkeypatch, axolotl, switch=switch)
    output = run.stdout.str()
    assert run.ret == 0, output + run.stderr.str()  # warn mode: every test still passes...
    leaks = _leaks(run)
    assert set(leaks) == LEAKING, output
    assert set(leaks) == _off_zero(pytester)  # exactly the tests the witness saw off zero
    assert leaks["test_train_8bit_experts"][0] == 4  # 2 steps x 2 checkpointed layers, one lost hold each
    counter, cached = leaks["test_checkpointed_training_step"]
    assert counter > 0 and cached > 0 and leaks["test_train_8bit_experts"][1] > 0
    assert leaks["test_disable_hook_called_directly"] == (-1, 0)  # 0.49.2's hook with no enable before it
    # ...the tests after a flagged one start at counter 0 (the plugin released it)...
    clean_starts = {"test_after_leak_starts_clean", "test_after_negative_counter_starts_clean"}
    assert clean_starts <= _outcomes(run, "PASSED")
    # ...and each flagged test got its one line: counter, bytes, cause, bnb-gc-fix's state.
    lines = [line for line in output.splitlines() if "ParametrizeCacheLeakWarning: " in line]
    assert len(lines) == 3, output
    assert all("bnb-gc-fix: not loaded in this process (BNB_GC_FIX='0')" in line for line in lines)
    assert "3 tests left torch's parametrization cache switched on" in output
    assert "parametrize-cache-check: warn" in output  # the header says the check is on


# --- the check switches the fix off itself (the package installed and on, BNB_GC_FIX unset) -----------

ONE_LEAKING_ONE_INNOCENT = """
import torch
from torch.utils.checkpoint import checkpoint

import quantized


def test_leaking():
    head = torch.nn.Linear(64, 64)
    tail = quantized.make(params=2)
    y = checkpoint(lambda v: tail(head(v).relu()), torch.randn(8, 64), use_reentrant=False)
    y.pow(2).mean().backward()


def test_innocent():
    quantized.make()(torch.randn(2, 64))
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_the_check_switches_the_fix_off_and_reports_the_leaking_test_by_name(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]
) -> None:
    pytester.makepyfile(test_suite=ONE_LEAKING_ONE_INNOCENT)
    warn = _witnessed(pytester, monkeypatch, *workers, "--parametrize-cache-check", switch=None)
    assert warn.ret == 0, warn.stdout.str() + warn.stderr.str()
    assert set(_leaks(warn)) == {"test_leaking"}  # the innocent test is not reported
    assert "its fix is switched off for this run" in warn.stdout.str()
    fail = _witnessed(pytester, monkeypatch, *workers, "--parametrize-cache-check-mode=fail", switch=None)
    assert fail.ret == 1
    assert _outcomes(fail, "ERROR") == {"test_leaking"}
    assert _outcomes(fail, "PASSED") == {"test_leaking", "test_innocent"}  # the calls passed
    # The control: the same suite with the fix switched off by hand reports the same test, and the
    # same suite without the check leaves the fix on (the leaking test does not leak) and says nothing.
    by_hand = _witnessed(pytester, monkeypatch, *workers, "--parametrize-cache-check", switch="0")
    assert set(_leaks(by_hand)) == {"test_leaking"}
    (pytester.path / "oracle.jsonl").unlink()
    unchecked = _witnessed(pytester, monkeypatch, *workers, switch=None)
    assert unchecked.ret == 0 and _off_zero(pytester) == set()  # the witness: no test left it on
    assert "parametrize-cache-check" not in unchecked.stdout.str()
    assert "parametrize cache check" not in unchecked.stdout.str()


def test_control_check_off_by_default_and_the_leak_poisons_later_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_shape=UPSTREAM_SHAPE)
    run = _witnessed(pytester, monkeypatch, switch="0")
    assert "parametrize cache check" not in run.stdout.str()
    assert "parametrize-cache-check" not in run.stdout.str()
    failed = _outcomes(run, "FAILED")
    assert {"test_after_leak_starts_clean", "test_after_negative_counter_starts_clean"} <= failed


def test_fail_mode_from_the_ini_option(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_shape=UPSTREAM_SHAPE)
    pytester.makeini("[pytest]\nparametrize_cache_check = fail\n")
    run = _witnessed(pytester, monkeypatch, switch="0")
    assert run.ret == 1
    # An error in the teardown of each leaking test, whose own call passed; the others pass.
    assert _outcomes(run, "ERROR") == {"test_checkpointed_training_step", "test_disable_hook_called_directly"}
    assert "test_after_leak_starts_clean" in _outcomes(run, "PASSED")
    assert "left torch's parametrization cache counter below zero: P._cache_enabled = -1" in run.stdout.str()


# --- who is blamed: fixtures (pytester runs) --------------------------------------------------------


@pytest.fixture
def unfixed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester, its runs with the fix off (leaks happen) and the quantized scenarios importable."""
    monkeypatch.setenv("BNB_GC_FIX", "0")
    monkeypatch.setenv("PYTHONPATH", str(SCENARIOS))
    return pytester


# A model fixture given one checkpointed warm-up step: its setup leaks one hold (bitsandbytes 0.49).
WARMED_MODEL = """
import pytest
import torch
import torch.nn.utils.parametrize as P
from torch.utils.checkpoint import checkpoint

import quantized


@pytest.fixture(scope="module")
def warmed_model():
    model = quantized.make()
    checkpoint(model, torch.randn(4, 64), use_reentrant=False).sum().backward()
    return model


def test_uses_the_model(warmed_model):
    assert warmed_model(torch.randn(2, 64)).shape == (2, 64)


def test_never_uses_the_model():
    assert P._cache_enabled == 0


def test_last_does_nothing():
    pass
"""


def test_a_fixture_leaking_in_its_setup_is_blamed_and_released(unfixed: pytest.Pytester) -> None:
    unfixed.makepyfile(test_warm=WARMED_MODEL)
    control = _run(unfixed)  # check off: the leak is real, and a test that never used the fixture inherits it
    control.assert_outcomes(passed=2, failed=1)
    control.stdout.fnmatch_lines(["FAILED test_warm.py::test_never_uses_the_model - assert 1 == 0*"])
    run = _run(unfixed, "--parametrize-cache-check=fail")
    # An error at the setup it happened in, naming the fixture; released: the later tests pass.
    run.assert_outcomes(passed=2, errors=1)
    run.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_uses_the_model*",
            "fixture 'warmed_model' (module scope) left torch's parametrization cache switched on in its "
            "setup (+1 that no P.cached() context holds): P._cache_enabled = 1, * bytes cached; *",
            "LEAK fixture 'warmed_model' (module scope), at test_warm.py::test_uses_the_model: *",
            "1 fixture left torch's parametrization cache switched on*",
        ]
    )
    assert "LEAK test_warm.py" not in run.stdout.str()  # no test blamed, the last one included


COUNTER_BUMP = """
import torch.nn.utils.parametrize as P


def test_leaks():
    P._cache_enabled += 1  # a hold nothing owns, as a skipped cache-off hook leaves


def test_after_starts_clean():
    assert P._cache_enabled == 0
"""


def test_the_switch_stands_before_paths_and_the_mode_is_an_option_of_its_own(
    unfixed: pytest.Pytester,
) -> None:
    suite = unfixed.mkdir("suite")
    (suite / "test_bump.py").write_text(COUNTER_BUMP)
    control = _run(unfixed, "suite/")  # check off: the next test inherits the leak
    control.assert_outcomes(passed=1, failed=1)
    warn = _run(unfixed, "--parametrize-cache-check", "suite/")
    warn.assert_outcomes(passed=2, warnings=1)
    warn.stdout.fnmatch_lines(
        [
            "parametrize-cache-check: warn (bnb-gc-fix; its fix is switched off for this run, *",
            "LEAK suite/test_bump.py::test_leaks: P._cache_enabled = 1, *",
        ]
    )
    fail_modes = [
        ("suite/", "--parametrize-cache-check-mode=fail"),  # the mode alone turns the check on
        ("--parametrize-cache-check=fail", "suite/"),  # the first spelling
        (
            "-o",
            "parametrize_cache_check=fail",
            "--parametrize-cache-check",
            "suite/",
        ),  # the switch keeps ini's
    ]
    for args in fail_modes:
        fail = _run(unfixed, *args)
        fail.assert_outcomes(passed=2, errors=1)
        fail.stdout.fnmatch_lines(
            ["parametrize-cache-check: fail (bnb-gc-fix; *", "ERROR suite/test_bump.py::test_leaks*"]
        )


def test_each_leak_is_a_junit_property_of_its_test(unfixed: pytest.Pytester) -> None:
    (unfixed.path / "test_bump.py").write_text(COUNTER_BUMP)
    run = _run(unfixed, "--parametrize-cache-check", "--junitxml=report.xml")
    run.assert_outcomes(passed=2, warnings=1)
    testcases = ET.parse(unfixed.path / "report.xml").getroot().iter("testcase")
    properties = {
        case.get("name"): [
            p.get("value") for p in case.iter("property") if p.get("name") == "parametrize_cache_leak"
        ]
        for case in testcases
    }
    assert properties["test_after_starts_clean"] == [], properties
    (value,) = properties["test_leaks"]
    leak = ast.literal_eval(value)  # junit XML writes the dict as str() does
    assert set(leak) == {"who", "counter", "cached_bytes", "message"}
    assert leak["who"] == "test_bump.py::test_leaks"
    assert (leak["counter"], leak["cached_bytes"]) == (1, 0)
    assert leak["message"].startswith(
        "test_bump.py::test_leaks left torch's parametrization cache switched on"
    )


FIXTURE_HOLDS = """
import sys

import pytest

KEPT = []


def test_nothing_imported():
    assert "torch" not in sys.modules
    assert "bnb_gc_fix" not in sys.modules


@pytest.fixture(scope="module")
def held_for_the_module():
    import torch.nn.utils.parametrize as P

    with P.cached():
        yield P


@pytest.fixture(scope="module")
def never_gives_it_back():
    import torch.nn.utils.parametrize as P

    context = P.cached()
    context.__enter__()
    KEPT.append(context)  # kept alive past the fixture, and never exited
    yield P


def test_first_under_a_module_hold(held_for_the_module):
    assert held_for_the_module._cache_enabled == 1


def test_second_under_a_module_hold(held_for_the_module):
    assert held_for_the_module._cache_enabled == 1


def test_under_a_hold_never_given_back(never_gives_it_back):
    assert never_gives_it_back._cache_enabled == 2


def test_last_does_nothing():
    pass
"""

AFTER_THE_HOLDS = """
def test_after_the_module_holds():
    import torch.nn.utils.parametrize as P

    assert P._cache_enabled == 0
"""


def test_plugin_imports_neither_torch_nor_the_package_and_blames_only_the_fixture_that_kept_its_hold(
    unfixed: pytest.Pytester,
) -> None:
    unfixed.makepyfile(test_first=FIXTURE_HOLDS, test_second=AFTER_THE_HOLDS)
    run = _run(unfixed, "--parametrize-cache-check=fail")
    # The hold kept on purpose is not reported (the control); the one never given back is, against its
    # fixture, at the teardown where the fixture was finalised, and released: the next file starts clean.
    run.assert_outcomes(passed=6, errors=1)
    run.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_last_does_nothing*",
            "fixture 'never_gives_it_back' (module scope) still held 1 P.cached() context(s) it entered "
            "after its finalizer: P._cache_enabled = 2, *",
            "LEAK fixture 'never_gives_it_back' (module scope), at test_first.py::test_last_does_nothing: *",
            "1 fixture left torch's parametrization cache switched on*",
        ]
    )
    assert "held_for_the_module" not in run.stdout.str()
    assert "LEAK test_" not in run.stdout.str()


# --- bitsandbytes' own tests/test_parametrize.py against 0.49.2 --------------------------------------

UPSTREAM_TESTS = Path(os.environ.get("BNB_GC_FIX_BNB_TESTS", cache_root() / "bitsandbytes-0.49-tests"))


@pytest.mark.downloads
def test_bitsandbytes_own_parametrize_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bitsandbytes' own tests/test_parametrize.py on 0.49.2, unfixed: flags exactly what the witness sees."""
    if not (UPSTREAM_TESTS / "tests" / "test_parametrize.py").exists():
        pytest.skip(
            f"bitsandbytes' tests are not at {UPSTREAM_TESTS} (PyPI has no sdist of bitsandbytes 0.49.2: "
            "put the tests/ folder of a checkout of its tag there, or point BNB_GC_FIX_BNB_TESTS at one)"
        )
    # The float32 cases: the float16/bfloat16 ones run the same hooks and triple the time (80 tests in
    # all, about 30 s here; none of them is flagged, nor are the 28 kept here). Its error bounds are
    # measured on unseeded random tensors and a case fails now and then (mean rel error 0.2612 against
    # 0.2611 seen once): each test starts from a fixed seed, so a run is the same run every time.
    pytester.makepyfile(seeded=SEEDED)
    monkeypatch.chdir(UPSTREAM_TESTS)  # its tests run from the checkout's root, as they do upstream
    args = ("tests/test_parametrize.py", "-p", "seeded", "--parametrize-cache-check", "-q")
    run = _witnessed(
        pytester, monkeypatch, *args, "-k", "not fp16 and not bf16", switch="0", pythonpath=(pytester.path,)
    )
    output = run.stdout.str()
    assert run.ret == 0, output + run.stderr.str()
    assert re.search(r"^\d+ passed", output.splitlines()[-1]), output[-2000:]
    assert (pytester.path / "oracle.jsonl").exists()  # the witness saw every test
    assert set(_leaks(run)) == _off_zero(pytester), output
