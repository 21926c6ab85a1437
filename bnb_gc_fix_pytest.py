"""pytest plugin: report the tests and fixtures that leave torch's parametrization cache switched on.

Opt in with ``--parametrize-cache-check`` (warn), ``--parametrize-cache-check-mode=warn|fail|off`` or the
ini option. A hold kept on purpose has a live owner, a ``P.cached()`` context entered and not exited: a
fixture's if it appeared in its setup. Any other change of the counter by a fixture's setup or teardown,
a context it holds after its finalizer, and after a test a counter other than the live fixtures' holds
(or tensors cached at 0) is a leak: reported, released, summarised. pytest imports this module in every
run, so it imports only the standard library and pytest: importing ``bnb_gc_fix`` activates the fix.
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
from typing import Any

import pytest

import _bnb_gc_fix_cache as cache

OFF, WARN, FAIL = MODES = ("off", "warn", "fail")

OPTION, MODE_OPTION = "--parametrize-cache-check", "--parametrize-cache-check-mode"
INI = "parametrize_cache_check"
# The user property, one per leak, of the teardown report of the test under way (junit XML shows it):
# `who` (the test's node id, or "fixture 'NAME' (SCOPE scope)"), `counter`, `bytes`, `message`.
PROPERTY = "parametrize_cache_leak"

_SWITCH = "parametrize_cache_check_switch"
_PLUGIN_NAME = "bnb_gc_fix_parametrize_cache_check"

_CAUSE_NEGATIVE = (
    "a hold given back twice: the cache-off hook (_disable_parametrization_cache) or a P.cached() exit ran "
    "without its matching enable; torch reads a negative counter as on and never empties the cache"
)
_CAUSE_CACHE = "the counter was put back to 0 without emptying P._cache"
_CAUSE_KEPT = "its finalizer did not exit a P.cached() context it entered, which something still keeps alive"


class ParametrizeCacheLeakWarning(pytest.PytestWarning):
    """A test or fixture left torch's parametrization cache switched on (``--parametrize-cache-check``)."""


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


def _fix_state() -> str:
    """Whether bnb-gc-fix was patching in this process, without importing it: its own status() where the
    process imported it (the switch as its activation read it), else the environment's switch."""
    status = getattr(sys.modules.get("bnb_gc_fix"), "status", None)
    if status is None:
        return f"bnb-gc-fix: not loaded in this process ({_switch_text(os.environ.get('BNB_GC_FIX'))})"
    try:
        now = status()
    except Exception as error:  # a report line must never break the run
        return f"bnb-gc-fix: status unknown ({type(error).__name__})"
    if now.state == "patched":
        return "bnb-gc-fix: patching"
    return f"bnb-gc-fix: not patching ({now.state}; {_switch_text(now.switch)})"


def _switch_text(switch: str | None) -> str:
    return "BNB_GC_FIX unset" if switch is None else f"BNB_GC_FIX={switch!r}"


def _suspended(generator: Any) -> bool:
    return generator is not None and inspect.getgeneratorstate(generator) == inspect.GEN_SUSPENDED


def _owners() -> list[Any]:
    """The live ``P.cached()`` contexts: its generators suspended at their ``yield`` (a scan of gc)."""
    cached = getattr(cache.parametrize(), "cached", None)
    code = getattr(getattr(cached, "__wrapped__", cached), "__code__", None)
    return [
        o for o in gc.get_objects() if type(o) is types.GeneratorType and o.gi_code is code and _suspended(o)
    ]


def _who(fixturedef: pytest.FixtureDef[Any]) -> str:
    return f"fixture '{fixturedef.argname}' ({fixturedef.scope} scope)"


class CacheCheck:
    """The check, registered by :func:`pytest_configure` when a mode other than off is asked for."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # By id of a FixtureDef: the P.cached() contexts each live fixture entered in its setup, and the
        # counter and those of its holds still owned when its teardown began.
        self.owned: dict[int, list[weakref.ref[Any]]] = {}
        self.teardowns: dict[int, tuple[int, int]] = {}
        self.setups: list[int] = []  # holds owned by fixtures set up inside each setup under way
        self.found: list[dict[str, Any]] = []  # leaks (PROPERTY's values) to report with the next test report
        self.troubles: list[str] = []  # the check's own failures, reported as warnings: never breaking
        self.leaks: list[tuple[str, str, int, int]] = []  # (who, test node id, counter, bytes) per leak

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
        counter, cached = cache.counter(), cache.cached_bytes()
        for owner in close:
            owner.close()
        if after is None:
            after = cache.counter()
        else:
            cache.reset(keep=after)
        emptied = ", cache emptied" if after == 0 else ""
        line = (
            f"{who} {what}: P._cache_enabled = {counter}{note}, {cached} bytes cached; {cause}; "
            f"{_fix_state()}. Released (counter {after}{emptied}) so later tests start clean."
        )
        self.found.append({"who": who, "counter": counter, "bytes": cached, "message": line})

    def _fixture_changed(self, fixturedef: pytest.FixtureDef[Any], phase: str, change: int) -> None:
        """Report and undo what a fixture's setup or teardown did to the counter beyond the holds it owns."""
        if change == 0:
            return
        if change > 0:
            what = f"left torch's parametrization cache switched on in its {phase}"
            what, cause = f"{what} (+{change} that no P.cached() context holds)", cache.CAUSE
        else:
            what, cause = f"gave back more holds than it took in its {phase} ({change})", _CAUSE_NEGATIVE
        self._report(_who(fixturedef), what, cause, cache.counter() - change)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[None, Any, None]:
        before = cache.counter()
        self.setups.append(0)  # what fixtures set up inside this one own is theirs, not this one's
        yield
        inner = self.setups.pop()
        with self._guard(f"after the setup of {_who(fixturedef)}"):
            rise = cache.counter() - before - inner
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
            self.teardowns[id(fixturedef)] = (cache.counter(), sum(_suspended(ref()) for ref in refs))

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        refs = self.owned.pop(id(fixturedef), [])
        start = self.teardowns.pop(id(fixturedef), None)
        if start is None:  # not set up since its last finalisation
            return
        with self._guard(f"after the teardown of {_who(fixturedef)}"):
            counter, held = start
            kept: list[Any] = [owner for owner in (ref() for ref in refs) if _suspended(owner)]
            change = cache.counter() - (counter - held + len(kept))
            if kept:
                what = f"still held {len(kept)} P.cached() context(s) it entered after its finalizer"
                self._report(_who(fixturedef), what, _CAUSE_KEPT, None, close=kept)
            self._fixture_changed(fixturedef, "teardown", change)

    def check(self, nodeid: str) -> None:
        """After a test's teardown: the counter must be the holds live fixtures own, the cache empty at 0."""
        counter = cache.counter()
        keep = sum(_suspended(ref()) for refs in self.owned.values() for ref in refs)
        if counter == keep and (keep != 0 or not getattr(cache.parametrize(), "_cache", None)):
            return
        orphans: list[Any] = []
        if counter > keep:
            what, cause = "left torch's parametrization cache switched on", cache.CAUSE
            claimed = self._claimed()  # a P.cached() context the test left open is closed, not reset
            orphans = [owner for owner in _owners() if id(owner) not in claimed]
        elif counter < 0:
            what, cause = "left torch's parametrization cache counter below zero", _CAUSE_NEGATIVE
        elif counter < keep:
            what, cause = "gave back a hold a live fixture took", _CAUSE_NEGATIVE
        else:
            what, cause = "left tensors in torch's parametrization cache", _CAUSE_CACHE
        self._report(nodeid, what, cause, keep, orphans, f" ({keep} held by live fixtures)" if keep else "")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        # Made right after its phase: in the teardown's, every fixture that ended with this test is finalised.
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
            item.user_properties.append((PROPERTY, leak))  # the test's later reports carry it too
            if call.when == "teardown":
                report.user_properties.append((PROPERTY, leak))
        if self.mode == WARN or not report.passed:
            try:
                for leak in found:
                    item.warn(ParametrizeCacheLeakWarning(leak["message"]))
                return
            except Exception:  # -W error made the warning an error: report it as one
                if not report.passed:
                    return
        report.outcome = "failed"
        report.longrepr = "\n".join(leak["message"] for leak in found)

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
        self.leaks += [(x["who"], "the end of the session", x["counter"], x["bytes"]) for x in self.found]
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", "parametrize cache check")
        if not self.leaks:
            write("no test or fixture left torch's parametrization cache switched on")
            return
        for who, nodeid, counter, cached in self.leaks:
            where = "" if who == nodeid else f", at {nodeid}"
            write(f"LEAK {who}{where}: P._cache_enabled = {counter}, {cached} bytes cached")
        tests = sum(who == nodeid for who, nodeid, _, _ in self.leaks)
        kinds = ((tests, "test"), (len(self.leaks) - tests, "fixture"))
        counts = [f"{n} {noun}{'s' if n > 1 else ''}" for n, noun in kinds if n]
        total = sum(cached for _, _, _, cached in self.leaks)
        write(
            f"{' and '.join(counts)} left torch's parametrization cache switched on, {total} bytes held in "
            f"all (released after each; mode {self.mode})"
        )
