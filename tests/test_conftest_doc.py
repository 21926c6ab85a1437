"""The documented ``conftest.py`` (docs/test-suites.md), loaded from the page itself so that it cannot rot,
run by real pytest runs on a small suite, each beside its control (the same suite without it). Each run
is a process of its own, forked from the warm parent (``python -m pytest``, its start-up hook run as the
``.pth`` runs it); its xdist workers are fresh interpreters.

The suite: an innocent test, a test whose checkpointed step through a 4-bit module leaves the cache on, a
test that fails on its own after leaking, a module-scoped fixture that leaks while it is set up, and a
test after each that asserts it starts clean. Its own conftest.py already defines the three runtest hooks
and ``pytest_configure`` (as bitsandbytes' own does: its call hook seeds torch before every test), and the
block is appended to it, as the page says: the suite's hooks all still run (issue 41's finding 5).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS, run_python

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

FIRST_LINE = "# conftest.py: bnb-gc-fix leak check"

COUNTER = "import torch.nn.utils.parametrize as P\n"
SUITE = {
    "test_a_leak.py": COUNTER
    + """
import torch
import quantized

def test_seeded_by_the_suites_own_call_hook():
    assert torch.initial_seed() == 0

def test_innocent():
    assert P._cache_enabled == 0

def test_leaks():
    quantized.checkpointed_counters(quantized.make(), steps=1)

def test_after_the_leak_starts_clean():
    assert P._cache_enabled == 0

def test_fails_on_its_own_after_leaking():
    quantized.checkpointed_counters(quantized.make(), steps=1)
    assert False, "the test's own failure"

def test_after_that_starts_clean():
    assert P._cache_enabled == 0
""",
    "test_b_fixture.py": COUNTER
    + """
import pytest
import quantized

@pytest.fixture(scope="module")
def warmed():
    module = quantized.make()
    quantized.checkpointed_counters(module, steps=1)  # a checkpointed warm-up step in the fixture
    return module

def test_uses_the_model(warmed):
    pass

def test_uses_it_again(warmed):
    pass

def test_never_uses_it():
    assert P._cache_enabled == 0
""",
}


# A plugin pytest loads before conftest.py (`-p early_plugin`): as it imports bitsandbytes' 4-bit module, the
# start-up hook asks for the fix and puts it into that module's hooks, so the block finds the fix asked
# for, which it cannot switch off: it stops the run.
EARLY_PLUGIN = """
import bitsandbytes.nn.parametrize
"""


# The suite's own conftest.py: the three runtest hooks and pytest_configure, each noting that it ran.
OWN_HOOKS = """
import os
import torch

def _ran(what):
    with open(os.path.join(os.path.dirname(__file__), "hooks.log"), "a") as log:
        log.write(what + "\\n")

def pytest_configure(config):
    _ran("configure")

def pytest_runtest_setup(item):
    _ran(f"setup {item.name}")

def pytest_runtest_call(item):
    torch.manual_seed(0)
    _ran(f"call {item.name}")

def pytest_runtest_teardown(item, nextitem):
    _ran(f"teardown {item.name}")
"""


def conftest_block() -> str:
    """The fenced python block of docs/test-suites.md whose first line is FIRST_LINE."""
    page = (ROOT / "docs" / "test-suites.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    [block] = [block for block in blocks if block.splitlines()[0] == FIRST_LINE]
    return block


def _suite(folder: Path, with_conftest: bool) -> Path:
    folder.mkdir()
    for name, source in SUITE.items():
        (folder / name).write_text(source)
    shutil.copy(SCENARIOS / "quantized.py", folder)  # the suite's own helper, beside its tests
    (folder / "early_plugin.py").write_text(EARLY_PLUGIN)
    block = "\n\n" + conftest_block() if with_conftest else ""
    (folder / "conftest.py").write_text(OWN_HOOKS + block)
    return folder


def _own_hooks_ran(folder: Path) -> bool:
    """Whether the suite's own hooks ran: pytest_configure, and each runtest hook for every test (the call
    hook where the setup passed)."""
    ran = set((folder / "hooks.log").read_text().splitlines())
    phases = [
        f"{phase} {test}"
        for test, outcome in EXPECTED.items()
        for phase in (("setup", "teardown") if outcome == "error" else ("setup", "call", "teardown"))
    ]
    return "configure" in ran and all(phase in ran for phase in phases)


def _pytest(folder: Path, switch: str | None, *options: str) -> dict[str, str]:
    """Each test's outcome (``passed``, ``failed``, ``error``), and the run's output under ``"output"``."""
    command = ["-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", *options]
    run = run_python(command, switch, cwd=folder, timeout=600)
    outcomes = {"output": run.stdout + run.stderr}
    for line in run.stdout.splitlines():
        found = re.match(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", line)
        if found:
            outcomes[found[2]] = found[1].lower()
    return outcomes


def _without_output(outcomes: dict[str, str]) -> dict[str, str]:
    return {test: outcome for test, outcome in outcomes.items() if test != "output"}


EXPECTED = {
    "test_seeded_by_the_suites_own_call_hook": "passed",
    "test_innocent": "passed",
    "test_leaks": "failed",
    "test_after_the_leak_starts_clean": "passed",
    "test_fails_on_its_own_after_leaking": "failed",
    "test_after_that_starts_clean": "passed",
    "test_uses_the_model": "error",  # the module-scoped fixture leaked while it was set up, in its setup
    "test_uses_it_again": "passed",
    "test_never_uses_it": "passed",
}


LEFT_ON = "torch's parametrization cache was left switched on (counter 0 -> "
ONE_PROCESS = ()
FIX_ON_BEFORE_THE_CONFTEST = ("-p", "early_plugin")
XDIST = ("-n", "2", "--dist", "loadfile")  # a module's tests on one worker: its fixture is set up once


@pytest.mark.parametrize("options", [ONE_PROCESS, XDIST], ids=["one-process", "xdist"])
def test_the_documented_conftest_fails_exactly_the_leaking_test_and_fixture(
    tmp_path: Path, options: tuple[str, ...]
) -> None:
    # BNB_GC_FIX unset and the start-up hook installed: the block switches the fix off by itself.
    folder = _suite(tmp_path / "checked", with_conftest=True)
    checked = _pytest(folder, None, *options)
    assert _without_output(checked) == EXPECTED, checked["output"]
    assert _own_hooks_ran(folder)  # beside the block's, the suite's own hooks (its control: the runs below)
    output = checked["output"]
    # Two reports, each heading its own section (the summary's lines repeat them as wide as the terminal).
    reports = [line for line in output.splitlines() if line.startswith(LEFT_ON)]
    assert len(reports) == 2, output
    assert "AssertionError: the test's own failure" in output  # its own failure, never replaced
    if options != ONE_PROCESS:
        return
    # The controls: without the block, the fix (on by default) hides the leak: a false all-clear...
    hidden_folder = _suite(tmp_path / "hidden", with_conftest=False)
    hidden = _without_output(_pytest(hidden_folder, None))
    assert hidden["test_leaks"] == hidden["test_uses_the_model"] == "passed", hidden
    assert _own_hooks_ran(hidden_folder) and hidden["test_seeded_by_the_suites_own_call_hook"] == "passed"
    # ...and with the fix off, nothing catches the leak, which poisons the tests after it.
    poisoned = _pytest(_suite(tmp_path / "poisoned", with_conftest=False), "0")
    assert _without_output(poisoned)["test_leaks"] == "passed", poisoned["output"]
    assert _without_output(poisoned)["test_after_the_leak_starts_clean"] == "failed", poisoned["output"]
    assert _without_output(poisoned)["test_never_uses_it"] == "failed", poisoned["output"]


def test_where_the_fix_turned_on_before_the_block_it_stops_the_run_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    folder = _suite(tmp_path / "early", with_conftest=True)
    stopped = _pytest(folder, None, *FIX_ON_BEFORE_THE_CONFTEST)
    said = "ERROR: bnb-gc-fix's fix is on and would hide the leak: run with BNB_GC_FIX=0"
    assert _without_output(stopped) == {} and said in stopped["output"], stopped["output"]
    # What it says to do works: the same run with BNB_GC_FIX=0 finds exactly the leaks.
    remedied = _pytest(_suite(tmp_path / "remedied", with_conftest=True), "0", *FIX_ON_BEFORE_THE_CONFTEST)
    assert _without_output(remedied) == EXPECTED, remedied["output"]


def test_the_block_is_complete_as_it_stands_and_short() -> None:
    block = conftest_block()
    compile(block, "conftest.py", "exec")  # it runs as a file of its own: no name it does not define
    code = [line for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert len(code) <= 45, len(code)  # 40 until the fix could no longer be switched off in a process
    assert "import torch" not in block  # it reads torch's module only if something imported it
