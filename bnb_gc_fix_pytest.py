"""pytest plugin: report the tests and fixtures that leave torch's parametrization cache switched on.

Opt in with ``pytest --parametrize-cache-check`` (a plain switch: anywhere on the command line; mode
warn) and set the mode with ``--parametrize-cache-check-mode=warn|fail|off`` (which alone turns the check
on too; the first spelling ``--parametrize-cache-check=fail`` still works), or the ini option
``parametrize_cache_check = warn|fail``; off by default.

**Who is blamed.** Torch's counter ``P._cache_enabled`` is above 0 while a hold is live. A hold kept on
purpose has a live owner: a ``P.cached()`` context entered and not exited, its generator suspended at
its ``yield``. When a fixture's setup (any scope) raised the counter, the plugin counts the owners that
appeared (a ``gc`` scan, only then): those holds are the fixture's until it is finalised. Any other
change the setup made is that fixture's leak: reported at once, naming the fixture and its scope, and
undone, so no later test runs with it. A fixture's teardown must leave the counter where it found it,
less the holds it owned; a ``P.cached()`` context it still holds after its finalizer is reported and
closed (its own exit runs), and any other change is reported and undone. After each test's teardown, a
counter other than the holds live fixtures own (or below zero, which torch reads as on), or tensors left
in ``P._cache`` at 0, is the test's leak. Each leak gets one line (counter, bytes cached, the usual cause,
whether bnb-gc-fix was patching in that process): a warning, or with ``fail`` an error of the phase
(setup, call or teardown) of the test under way; the teardown report of that test carries it as a user
property, and a summary at the end lists every leak and the bytes held.

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
globals directly. With the check off it registers nothing beyond its options.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import os
import sys
import types
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import Any, NamedTuple

import pytest

OFF = "off"
WARN = "warn"
FAIL = "fail"
MODES = (OFF, WARN, FAIL)

OPTION = "--parametrize-cache-check"
MODE_OPTION = "--parametrize-cache-check-mode"
INI = "parametrize_cache_check"
PROPERTY = "parametrize_cache_leak"
"""The ``user_properties`` entry, one per leak, of the teardown report of the test under way (junit XML
shows it): ``who`` (the test's node id, or the fixture), ``counter``, ``bytes``, ``message``."""

_SWITCH = "parametrize_cache_check_switch"
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
_CAUSE_KEPT = "its finalizer did not exit a P.cached() context it entered, which something still keeps alive"


class ParametrizeCacheLeakWarning(pytest.PytestWarning):
    """A test or fixture left torch's parametrization cache switched on (``--parametrize-cache-check``)."""


class Leak(NamedTuple):
    who: str
    """The test's node id, or ``fixture 'NAME' (SCOPE scope)``."""
    counter: int
    cached: int
    line: str


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bnb-gc-fix", "parametrization cache check (bnb-gc-fix)")
    group.addoption(
        OPTION,
        action="store_true",
        dest=_SWITCH,
        help="report each test or fixture that leaves torch's parametrization cache switched on, and "
        f"release the cache (mode: {MODE_OPTION}, else the ini option, else warn)",
    )
    group.addoption(
        MODE_OPTION,
        choices=MODES,
        default=None,
        dest=INI,
        help="warn (a warning per leak), fail (an error in the phase it happened in) or off; turns the "
        "check on by itself",
    )
    for mode in MODES:  # the first spelling, --parametrize-cache-check=fail; not in --help
        group.addoption(
            f"{OPTION}={mode}", action="store_const", const=mode, dest=INI, help=argparse.SUPPRESS
        )
    parser.addini(INI, "parametrization cache check: off (default), warn or fail", default=OFF)


def pytest_configure(config: pytest.Config) -> None:
    chosen = config.getoption(INI)
    raw = chosen or config.getini(INI) or OFF
    mode = str(raw).strip().lower()
    if mode not in MODES:
        raise pytest.UsageError(f"{INI} = {raw!r}: expected one of {', '.join(MODES)}")
    if mode == OFF and chosen is None and config.getoption(_SWITCH):
        mode = WARN
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


def _suspended(generator: Any) -> bool:
    return generator is not None and inspect.getgeneratorstate(generator) == inspect.GEN_SUSPENDED


def _owners() -> list[Any]:
    """The live ``P.cached()`` contexts: its generators suspended at their ``yield`` (a scan of gc)."""
    cached = getattr(_parametrize(), "cached", None)
    code = getattr(getattr(cached, "__wrapped__", cached), "__code__", None)
    return [
        o for o in gc.get_objects() if type(o) is types.GeneratorType and o.gi_code is code and _suspended(o)
    ]


def _who(fixturedef: pytest.FixtureDef[Any]) -> str:
    return f"fixture '{fixturedef.argname}' ({fixturedef.scope} scope)"


def _release(parametrize: Any, keep: int) -> None:
    """Counter set to ``keep`` (the holds that have an owner); cache emptied at 0."""
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
        self.owned: dict[int, list[weakref.ref[Any]]] = {}
        """The ``P.cached()`` contexts each live fixture entered in its setup (by id of its FixtureDef)."""
        self.setups: list[int] = []
        """Holds owned by the fixtures set up inside each fixture setup under way (innermost last)."""
        self.teardowns: dict[int, tuple[int, int]] = {}
        """Counter and the fixture's holds still owned when its teardown began (by id of its FixtureDef)."""
        self.found: list[Leak] = []
        """Leaks found since the last test report, to report with the next one."""
        self.troubles: list[str] = []
        """The check's own failures, to report as warnings: they never break the run."""
        self.leaks: list[tuple[str, str, int, int]] = []
        """(who, node id of the test under way, counter, bytes) of each leak (on the xdist controller)."""

    def pytest_report_header(self) -> str:
        return f"parametrize-cache-check: {self.mode} (bnb-gc-fix)"

    @contextlib.contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        try:
            yield
        except Exception as error:  # the check must never break the run
            self.troubles.append(f"the parametrize cache check failed {where}: {error!r}")

    def _claimed(self) -> set[int]:
        return {id(ref()) for refs in self.owned.values() for ref in refs}

    def _report(
        self, who: str, what: str, cause: str, after: int | None, close: Sequence[Any] = (), note: str = ""
    ) -> None:
        """Queue one leak's line, then release: close the contexts ``close`` (their own exit gives their
        hold back, and empties the cache at 0), and set the counter to ``after`` unless None."""
        parametrize = _parametrize()
        counter, cached = _counter(), _cached_bytes(parametrize)
        for owner in close:
            owner.close()
        if after is None:
            after = _counter()
        else:
            _release(parametrize, after)
        emptied = ", cache emptied" if after == 0 else ""
        line = (
            f"{who} {what}: P._cache_enabled = {counter}{note}, {cached} bytes cached; {cause}; "
            f"{_fix_state()}. Released (counter {after}{emptied}) so later tests start clean."
        )
        self.found.append(Leak(who, counter, cached, line))

    def _fixture_changed(self, fixturedef: pytest.FixtureDef[Any], phase: str, change: int) -> None:
        """Report and undo what a fixture's setup or teardown did to the counter beyond the holds it owns."""
        if change == 0:
            return
        if change > 0:
            what = f"left torch's parametrization cache switched on in its {phase}"
            what += f" (+{change} that no P.cached() context holds)"
            cause = _CAUSE_ON
        else:
            what, cause = f"gave back more holds than it took in its {phase} ({change})", _CAUSE_NEGATIVE
        self._report(_who(fixturedef), what, cause, _counter() - change)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[None, Any, None]:
        before = _counter()
        self.setups.append(0)  # what fixtures set up inside this one own is theirs, not this one's
        yield
        inner = self.setups.pop()
        with self._guard(f"after the setup of {_who(fixturedef)}"):
            rise = _counter() - before - inner
            owners: list[Any] = []
            if rise > 0:  # a hold kept on purpose has an owner that appeared with it
                claimed = self._claimed()
                owners = [owner for owner in _owners() if id(owner) not in claimed][:rise]
                self.owned[id(fixturedef)] = [weakref.ref(owner) for owner in owners]
            if self.setups:
                self.setups[-1] += inner + len(owners)
            self._fixture_changed(fixturedef, "setup", rise - len(owners))
            # Finalizers run last in, first out: this one runs just before the fixture's own teardown.
            fixturedef.addfinalizer(functools.partial(self._teardown_begins, fixturedef))

    def _teardown_begins(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        with self._guard(f"before the teardown of {_who(fixturedef)}"):
            refs = self.owned.get(id(fixturedef), [])
            self.teardowns[id(fixturedef)] = (_counter(), sum(_suspended(ref()) for ref in refs))

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        refs = self.owned.pop(id(fixturedef), [])
        start = self.teardowns.pop(id(fixturedef), None)
        if start is None:  # not set up since its last finalisation
            return
        with self._guard(f"after the teardown of {_who(fixturedef)}"):
            counter, held = start
            kept: list[Any] = [owner for owner in (ref() for ref in refs) if _suspended(owner)]
            change = _counter() - (counter - held + len(kept))
            if kept:
                what = f"still held {len(kept)} P.cached() context(s) it entered after its finalizer"
                self._report(_who(fixturedef), what, _CAUSE_KEPT, None, close=kept)
            self._fixture_changed(fixturedef, "teardown", change)

    def check(self, nodeid: str) -> None:
        """After a test's teardown: the counter must be the holds live fixtures own, the cache empty at 0."""
        parametrize = _parametrize()
        if parametrize is None:
            return
        counter = int(getattr(parametrize, "_cache_enabled", 0))
        keep = sum(_suspended(ref()) for refs in self.owned.values() for ref in refs)
        cache = getattr(parametrize, "_cache", None) or {}
        if counter == keep and (keep != 0 or not cache):
            return
        orphans: list[Any] = []
        if counter > keep:
            what, cause = "left torch's parametrization cache switched on", _CAUSE_ON
            claimed = self._claimed()  # a P.cached() context the test left open is closed, not reset
            orphans = [owner for owner in _owners() if id(owner) not in claimed]
        elif counter < 0:
            what, cause = "left torch's parametrization cache counter below zero", _CAUSE_NEGATIVE
        elif counter < keep:
            what, cause = "gave back a hold a live fixture took", _CAUSE_NEGATIVE
        else:
            what, cause = "left tensors in torch's parametrization cache", _CAUSE_CACHE
        held = f" ({keep} held by live fixtures)" if keep else ""
        self._report(nodeid, what, cause, keep, orphans, held)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        # Each report is made right after its phase: in the teardown's, every fixture that ended with this
        # test has been finalised.
        if call.when == "teardown":
            with self._guard(f"after {item.nodeid}"):
                self.check(item.nodeid)
        found, self.found = self.found, []
        troubles, self.troubles = self.troubles, []
        outcome = yield
        report = outcome.get_result()
        for text in troubles:
            with contextlib.suppress(Exception):
                item.warn(ParametrizeCacheLeakWarning(f"{item.nodeid}: {text}"))
        if not found:
            return
        for leak in found:
            value = {"who": leak.who, "counter": leak.counter, "bytes": leak.cached, "message": leak.line}
            item.user_properties.append((PROPERTY, value))  # the test's later reports carry it too
            if call.when == "teardown":
                report.user_properties.append((PROPERTY, value))
        if self.mode == WARN or not report.passed:
            try:
                for leak in found:
                    item.warn(ParametrizeCacheLeakWarning(leak.line))
                return
            except Exception:  # -W error made the warning an error: report it as one
                if not report.passed:
                    return
        report.outcome = "failed"
        report.longrepr = "\n".join(leak.line for leak in found)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for name, value in report.user_properties:
            if name == PROPERTY and isinstance(value, dict):
                who = str(value.get("who", report.nodeid))
                self.leaks.append((who, report.nodeid, int(value["counter"]), int(value["bytes"])))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(terminalreporter.config, "workerinput"):  # an xdist worker: the controller reports
            return
        # Fixtures finalised after the last test report (an interrupted run): their leaks are here only.
        self.leaks += [(leak.who, "the end of the session", leak.counter, leak.cached) for leak in self.found]
        terminalreporter.write_sep("=", "parametrize cache check")
        if not self.leaks:
            terminalreporter.write_line("no test or fixture left torch's parametrization cache switched on")
            return
        for who, nodeid, counter, cached in self.leaks:
            where = "" if who == nodeid else f", at {nodeid}"
            terminalreporter.write_line(
                f"LEAK {who}{where}: P._cache_enabled = {counter}, {cached} bytes cached"
            )
        tests = sum(who == nodeid for who, nodeid, _, _ in self.leaks)
        counts = [
            f"{n} {noun}{'s' if n > 1 else ''}"
            for n, noun in ((tests, "test"), (len(self.leaks) - tests, "fixture"))
            if n
        ]
        total = sum(cached for _, _, _, cached in self.leaks)
        terminalreporter.write_line(
            f"{' and '.join(counts)} left torch's parametrization cache switched on, {total} bytes held in "
            f"all (released after each; mode {self.mode})"
        )
