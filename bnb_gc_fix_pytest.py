"""pytest plugin: report tests that leave torch's parametrization cache switched on.

Opt in with ``pytest --parametrize-cache-check`` (warn) or ``--parametrize-cache-check=fail``, or the
ini option ``parametrize_cache_check = warn|fail``; off by default. After each test (its teardown
included, so a function-scoped fixture that holds ``P.cached()`` and releases it in its teardown is
not reported), if ``torch.nn.utils.parametrize`` is imported and its counter ``_cache_enabled`` is not
0 (torch reads a negative counter as on too) or its ``_cache`` still holds tensors, the test gets one
line (counter, bytes held, the usual cause, whether bnb-gc-fix was patching in that process) as a
warning, or as an error in its teardown with ``fail``; the cache is then released (counter 0, cache
emptied, as :func:`bnb_gc_fix.reset`) so later tests start clean. A summary at the end lists the tests
that leaked and the bytes they held. A hold a wider-scoped fixture takes in its setup (a module
fixture entering ``P.cached()``) is that fixture's until its finalizer runs, and is not reported.

**Why this module lives outside the** ``bnb_gc_fix`` **package.** pytest imports every ``pytest11``
entry point at start-up, in every pytest run of an environment where bnb-gc-fix is installed, whether
the check is on or not. Importing anything inside the package runs ``bnb_gc_fix/__init__.py``, which
activates the fix: that would change the process under test (the fix armed at pytest start-up instead
of when bitsandbytes is first imported, ``status().via`` saying "import", and a test suite that never
imports bnb-gc-fix running patched). So, like ``_bnb_gc_fix_boot``, this is a top-level module that
imports only the standard library and pytest, never torch and never ``bnb_gc_fix``. It reads torch's
counter through ``sys.modules``, asks ``bnb_gc_fix.status()`` only when the process under test has
imported bnb-gc-fix itself, and releases the cache through ``bnb_gc_fix.gate.reset()`` only when that
module is already loaded (then every gate's holds are forgotten too), else by setting torch's two
globals directly. With the check off it registers nothing beyond its two options.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Generator
from typing import Any

import pytest

OFF = "off"
WARN = "warn"
FAIL = "fail"
MODES = (OFF, WARN, FAIL)

OPTION = "--parametrize-cache-check"
INI = "parametrize_cache_check"
PROPERTY = "parametrize_cache_leak"
"""The ``user_properties`` entry a leaking test's teardown report carries (and junit XML shows)."""

_PARAMETRIZE = "torch.nn.utils.parametrize"
_PLUGIN_NAME = "bnb_gc_fix_parametrize_cache_check"

_CAUSE_ON = (
    "usually a forward hook skipped by an exception: non-reentrant activation checkpointing stops its "
    "recompute early by raising inside a forward, and a plain forward hook that switches the cache off "
    "never runs (bitsandbytes 0.48-0.49 replace_parameter_4bit, axolotl <= 0.19 replace_parameter_8bit), "
    "or a KeyboardInterrupt mid-forward"
)
_CAUSE_NEGATIVE = (
    "a hold given back twice: the cache-off hook (_disable_parametrization_cache) or a P.cached() exit ran "
    "without its matching enable; torch reads a negative counter as on and never empties the cache"
)
_CAUSE_CACHE = "the counter was put back to 0 without emptying P._cache"


class ParametrizeCacheLeakWarning(pytest.PytestWarning):
    """A test left torch's parametrization cache switched on (``--parametrize-cache-check``)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bnb-gc-fix", "parametrization cache check (bnb-gc-fix)")
    group.addoption(
        OPTION,
        nargs="?",
        const=WARN,
        default=None,
        choices=MODES,
        dest=INI,
        metavar="MODE",
        help="after each test, report it if torch's parametrization cache is still switched on, and "
        "release the cache. MODE: warn (the default when the flag is given: a warning), fail (an error in "
        "the test's teardown) or off. Write it as --parametrize-cache-check=fail, or after the paths.",
    )
    parser.addini(INI, "parametrization cache check: off (default), warn or fail", default=OFF)


def pytest_configure(config: pytest.Config) -> None:
    raw = config.getoption(INI) or config.getini(INI) or OFF
    mode = str(raw).strip().lower()
    if mode not in MODES:
        raise pytest.UsageError(f"{INI} = {raw!r}: expected one of {', '.join(MODES)}")
    if mode != OFF:
        config.pluginmanager.register(CacheCheck(mode), _PLUGIN_NAME)


def _parametrize() -> Any:
    return sys.modules.get(_PARAMETRIZE)


def _counter() -> int:
    parametrize = _parametrize()
    return 0 if parametrize is None else int(getattr(parametrize, "_cache_enabled", 0))


def _cached_bytes(parametrize: Any) -> int:
    torch = sys.modules.get("torch")
    tensor_type = getattr(torch, "Tensor", None)
    total = 0
    for value in list(getattr(parametrize, "_cache", {}).values()):
        if tensor_type is not None and isinstance(value, tensor_type):
            total += value.numel() * value.element_size()
    return total


def _fix_state() -> str:
    """Whether bnb-gc-fix was patching in this process, without importing it."""
    switch = os.environ.get("BNB_GC_FIX")
    switch_text = "BNB_GC_FIX unset" if switch is None else f"BNB_GC_FIX={switch!r}"
    fix = sys.modules.get("bnb_gc_fix")
    status = getattr(fix, "status", None)
    if status is None:
        return f"bnb-gc-fix: not loaded in this process ({switch_text})"
    try:
        state = str(status().state)
    except Exception as error:  # a report line must never break the run
        return f"bnb-gc-fix: status unknown ({type(error).__name__})"
    if state == "patched":
        return "bnb-gc-fix: patching"
    return f"bnb-gc-fix: not patching ({state}; {switch_text})"


def _release(parametrize: Any, keep: int) -> None:
    """Counter back to ``keep`` (the holds of live wider-scoped fixtures); cache emptied at 0."""
    gate = sys.modules.get("bnb_gc_fix.gate")
    reset = getattr(gate, "reset", None)
    if keep == 0 and reset is not None:
        reset()  # also forgets every gate's holds
        return
    parametrize._cache_enabled = keep
    if keep == 0:
        parametrize._cache = {}


class CacheCheck:
    """The check, registered by :func:`pytest_configure` when a mode other than off is asked for."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.fixture_holds: dict[int, int] = {}
        """Holds taken by the setup of a live fixture wider than function scope (by id of its def)."""
        self.setups: list[int] = []
        """Holds taken by fixtures set up inside each fixture setup under way (innermost last)."""
        self.leaks: list[tuple[str, int, int]] = []
        """(node id, counter, bytes) of each test reported (on the controller, under xdist)."""

    def pytest_report_header(self) -> str:
        return f"parametrize-cache-check: {self.mode} (bnb-gc-fix)"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[None, Any, None]:
        before = _counter()
        self.setups.append(0)  # what fixtures set up inside this one take is theirs, not this one's
        try:
            yield
        finally:
            inner = self.setups.pop()
            taken = _counter() - before
            if self.setups:
                self.setups[-1] += taken
            if taken != inner and fixturedef.scope != "function":
                key = id(fixturedef)
                self.fixture_holds[key] = self.fixture_holds.get(key, 0) + taken - inner

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        self.fixture_holds.pop(id(fixturedef), None)

    def check(self, nodeid: str) -> tuple[str, int, int] | None:
        """After a test's teardown: the report line, counter and bytes, or None; releases the cache."""
        parametrize = _parametrize()
        if parametrize is None:
            return None
        counter = int(getattr(parametrize, "_cache_enabled", 0))
        keep = sum(self.fixture_holds.values())
        cache = getattr(parametrize, "_cache", None) or {}
        if counter == keep and (keep != 0 or not cache):
            return None
        cached = _cached_bytes(parametrize)
        if counter > keep:
            what, cause = "left torch's parametrization cache switched on", _CAUSE_ON
        elif counter < 0:
            what, cause = "left torch's parametrization cache counter below zero", _CAUSE_NEGATIVE
        elif counter < keep:
            what, cause = "gave back a hold a live fixture took", _CAUSE_NEGATIVE
        else:
            what, cause = "left tensors in torch's parametrization cache", _CAUSE_CACHE
        held = f" ({keep} held by live fixtures)" if keep else ""
        _release(parametrize, keep)
        line = (
            f"{nodeid} {what}: P._cache_enabled = {counter}{held}, {cached} bytes cached; {cause}; "
            f"{_fix_state()}. Released (counter {keep}, cache emptied) so later tests start clean."
        )
        return line, counter, cached

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        # The teardown report is made right after the teardown phase: every function-scoped fixture
        # (and any wider one that ended with this test) has been finalised.
        found = None
        if call.when == "teardown":
            try:
                found = self.check(item.nodeid)
            except Exception as error:  # the check must never break the run
                with contextlib.suppress(Exception):
                    item.warn(ParametrizeCacheLeakWarning(f"{item.nodeid}: the check failed: {error!r}"))
        outcome = yield
        if found is None:
            return
        line, counter, cached = found
        report = outcome.get_result()
        report.user_properties.append((PROPERTY, {"counter": counter, "bytes": cached, "message": line}))
        if self.mode == WARN or not report.passed:
            try:
                item.warn(ParametrizeCacheLeakWarning(line))
                return
            except Exception:  # -W error made the warning an error: report it as one
                if not report.passed:
                    return
        report.outcome = "failed"
        report.longrepr = line

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for name, value in report.user_properties:
            if name == PROPERTY and isinstance(value, dict):
                self.leaks.append((report.nodeid, int(value["counter"]), int(value["bytes"])))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(terminalreporter.config, "workerinput"):  # an xdist worker: the controller reports
            return
        terminalreporter.write_sep("=", "parametrize cache check")
        if not self.leaks:
            terminalreporter.write_line("no test left torch's parametrization cache switched on")
            return
        for nodeid, counter, cached in self.leaks:
            terminalreporter.write_line(f"LEAK {nodeid}: P._cache_enabled = {counter}, {cached} bytes cached")
        total = sum(cached for _, _, cached in self.leaks)
        tests = "test" if len(self.leaks) == 1 else "tests"
        terminalreporter.write_line(
            f"{len(self.leaks)} {tests} left torch's parametrization cache switched on, {total} bytes "
            f"held in all (released after each; mode {self.mode})"
        )
