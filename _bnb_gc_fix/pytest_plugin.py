"""pytest plugin: report the tests and fixtures that leave torch's parametrization cache switched on.

Opt in with ``--parametrize-cache-check`` (warn mode), with ``--parametrize-cache-check-mode=warn|fail|off``,
or with the ini option ``parametrize_cache_check``. The check switches bnb-gc-fix's own fix off for the
whole run (``BNB_GC_FIX=0``, set before any conftest or test module is imported, and inherited by xdist
workers), since the fix would hide the very leak the check is for; without the check the plugin changes
nothing.

A hold kept on purpose has a live owner: a ``P.cached()`` context entered and not yet exited. Such a
context belongs to a fixture when it appeared during that fixture's setup. Everything else is a leak,
which is reported, released at once and summarised at the end of the session:

* a change of the counter by a fixture's setup or teardown that no such context accounts for;
* a context that a fixture still holds after its finalizer;
* after a test, a counter other than the holds the live fixtures own, or tensors left cached at 0.

pytest imports this module in every run, so it imports only the standard library, pytest and the
private package (``_bnb_gc_fix``): importing ``bnb_gc_fix`` would turn the fix on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import inspect
import os
import sys
import types
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import Any, TypeVar

import pytest

import _bnb_gc_fix as words
from _bnb_gc_fix import cache

OFF = "off"
WARN = "warn"
FAIL = "fail"
MODES = (OFF, WARN, FAIL)

OPTION = "--parametrize-cache-check"
MODE_OPTION = "--parametrize-cache-check-mode"
INI = "parametrize_cache_check"
# The junit user property: one per leak, on the teardown report of the test under way (junit XML shows
# it). Its value is Leak.as_property(): the keys `who`, `counter`, `cached_bytes` and `message`.
PROPERTY = "parametrize_cache_leak"

_SWITCH = "parametrize_cache_check_switch"
# What the check sets BNB_GC_FIX to for its run: a spelling of off (_bnb_gc_fix.parse).
_FIX_OFF = "0"
_PLUGIN_NAME = "bnb_gc_fix_parametrize_cache_check"

# Where the summary places the leaks of fixtures finalised after the last test report.
_SESSION_END = "the end of the session"

_CAUSE_NEGATIVE = (
    f"a hold given back twice: the cache-off hook ({words.DISABLE_HOOK}) or a P.cached() exit ran "
    "without its matching enable; torch reads a negative counter as on and never empties the cache"
)
_CAUSE_CACHE = "the counter was put back to 0 without emptying P._cache"
_CAUSE_KEPT = "its finalizer did not exit a P.cached() context it entered, which something still keeps alive"

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Leak:
    """One leak: who left torch's parametrization cache switched on, what was held then, and the line
    that reports it. Built with keyword arguments."""

    who: str  # the test's node id, or "fixture 'NAME' (SCOPE scope)"
    counter: int  # P._cache_enabled when the leak was found, before its release
    cached_bytes: int  # the bytes of the tensors in P._cache then
    message: str  # the line the warning or the error shows
    # Where the summary places it: the node id of the test whose report carried it, or _SESSION_END.
    # It is empty until then, and it is no part of PROPERTY's value.
    at: str = ""

    def as_property(self) -> dict[str, Any]:
        """PROPERTY's value: a JSON-ready dict, since junit XML and xdist carry it between processes."""
        return {
            "who": self.who,
            "counter": self.counter,
            "cached_bytes": self.cached_bytes,
            "message": self.message,
        }

    @classmethod
    def from_property(cls, value: dict[str, Any], *, at: str) -> Leak:
        """The leak a PROPERTY value describes, carried by the report of test ``at``."""
        return cls(
            who=str(value.get("who", at)),
            counter=int(value["counter"]),
            cached_bytes=int(value["cached_bytes"]),
            message=str(value.get("message", "")),
            at=at,
        )


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
    # The first spelling, --parametrize-cache-check=fail, still works; --help does not show it.
    for mode in MODES:
        group.addoption(
            f"{OPTION}={mode}", action="store_const", const=mode, dest=INI, help=argparse.SUPPRESS
        )
    parser.addini(INI, "parametrization cache check: off (default), warn or fail", default=OFF)


def _mode(config: pytest.Config, options: argparse.Namespace) -> tuple[str, str]:
    """The mode the command line and the ini file ask for, and the value it was read from (a mode
    that is not known is the caller's to refuse)."""
    chosen = getattr(options, INI, None)
    raw = str(chosen or config.getini(INI) or OFF)
    mode = raw.strip().lower()
    # The plain switch keeps a mode the ini file asks for, and means warn where nothing asks for one.
    if mode == OFF and chosen is None and getattr(options, _SWITCH, False):
        mode = WARN
    return mode, raw


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """With the check on, switch the fix off before any conftest or test module is imported."""
    mode, _ = _mode(early_config, early_config.known_args_namespace)
    if mode in (WARN, FAIL):
        _switch_the_fix_off(early_config)


def _switch_the_fix_off(config: pytest.Config) -> None:
    """``BNB_GC_FIX=0`` for this run and the processes it starts (xdist's workers among them), put
    back as it was when the run ends; where the fix is on already, it is turned off."""
    previous = os.environ.get(words.VARIABLE)
    os.environ[words.VARIABLE] = _FIX_OFF
    config.add_cleanup(functools.partial(_restore_switch, previous))
    package = sys.modules.get(words.PUBLIC)
    if package is not None:
        package.deactivate()


def _restore_switch(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(words.VARIABLE, None)
    else:
        os.environ[words.VARIABLE] = previous


def pytest_configure(config: pytest.Config) -> None:
    mode, raw = _mode(config, config.option)
    if mode not in MODES:
        raise pytest.UsageError(f"{INI} = {raw!r}: expected one of {', '.join(MODES)}")
    if mode != OFF:
        config.pluginmanager.register(CacheCheck(mode), _PLUGIN_NAME)


def _fix_state() -> str:
    """Whether bnb-gc-fix was patching in this process, found without importing it.

    Where the process imported it, its own status() says (with the switch as its activation read it);
    elsewhere, the environment's switch is all there is to tell.
    """
    status = getattr(sys.modules.get(words.PUBLIC), "status", None)
    if status is None:
        return f"bnb-gc-fix: not loaded in this process ({_switch_text(os.environ.get(words.VARIABLE))})"
    try:
        now = status()
    except Exception as error:  # A report line must never break the run.
        return f"bnb-gc-fix: status unknown ({type(error).__name__})"
    if now.state == words.PATCHED:
        return "bnb-gc-fix: patching"
    return f"bnb-gc-fix: not patching ({now.state}; {_switch_text(now.switch)})"


def _switch_text(switch: str | None) -> str:
    if switch is None:
        return f"{words.VARIABLE} unset"
    return f"{words.VARIABLE}={switch!r}"


def _suspended(generator: Any) -> bool:
    return generator is not None and inspect.getgeneratorstate(generator) == inspect.GEN_SUSPENDED


def _owners() -> list[Any]:
    """The live ``P.cached()`` contexts: its generators suspended at their ``yield`` (a scan of gc)."""
    cached = getattr(cache.parametrize(), "cached", None)
    code = getattr(getattr(cached, "__wrapped__", cached), "__code__", None)
    return [
        o for o in gc.get_objects() if type(o) is types.GeneratorType and o.gi_code is code and _suspended(o)
    ]


def _release(close: Sequence[Any], keep: int | None) -> int:
    """Release the cache, and return the counter it is left at.

    First the contexts ``close`` are closed: each one's own exit gives its hold back, and empties the
    cache at 0. Then the counter is set to ``keep`` holds, unless ``keep`` is None.
    """
    for owner in close:
        owner.close()
    if keep is None:
        return cache.counter()
    cache.reset(keep=keep)
    return keep


def _who(fixturedef: pytest.FixtureDef[Any]) -> str:
    return f"fixture '{fixturedef.argname}' ({fixturedef.scope} scope)"


def _drain(queue: list[_T]) -> list[_T]:
    """Empty ``queue``, and return what it held."""
    taken = list(queue)
    queue.clear()
    return taken


def _warn_troubles(item: pytest.Item, troubles: list[str]) -> None:
    """Warn of the check's own failures; a warning that fails (``-W error``) is dropped."""
    for text in troubles:
        with contextlib.suppress(Exception):
            item.warn(ParametrizeCacheLeakWarning(f"{item.nodeid}: {text}"))


def _attach(item: pytest.Item, report: pytest.TestReport, leaks: list[Leak], when: str) -> None:
    """Give each leak's PROPERTY to the test's later reports, and to this one if it is the teardown's."""
    for leak in leaks:
        value = leak.as_property()
        item.user_properties.append((PROPERTY, value))
        if when == "teardown":
            report.user_properties.append((PROPERTY, value))


def _warned(item: pytest.Item, leaks: list[Leak]) -> bool:
    """Warn of each leak. False where ``-W error`` made a warning an error, which the caller then
    reports as one."""
    try:
        for leak in leaks:
            item.warn(ParametrizeCacheLeakWarning(leak.message))
    except Exception:
        return False
    return True


def _fail(report: pytest.TestReport, leaks: list[Leak]) -> None:
    """Turn the report of the phase under way into an error that gives each leak's line."""
    report.outcome = "failed"
    report.longrepr = "\n".join(leak.message for leak in leaks)


def _leak_line(leak: Leak) -> str:
    """The summary's line for one leak; a fixture's names the test it was reported at."""
    where = ""
    if leak.who != leak.at:
        where = f", at {leak.at}"
    return f"LEAK {leak.who}{where}: P._cache_enabled = {leak.counter}, {leak.cached_bytes} bytes cached"


def _plural(count: int, noun: str) -> str:
    if count > 1:
        return f"{count} {noun}s"
    return f"{count} {noun}"


def _total_line(leaks: list[Leak], mode: str) -> str:
    """The summary's last line: how many tests and fixtures leaked, and the bytes they held."""
    # A test's own leak is carried by its own report; a fixture's names the fixture instead.
    tests = sum(leak.who == leak.at for leak in leaks)
    fixtures = len(leaks) - tests
    counts = [_plural(n, noun) for n, noun in ((tests, "test"), (fixtures, "fixture")) if n]
    total = sum(leak.cached_bytes for leak in leaks)
    return (
        f"{' and '.join(counts)} left torch's parametrization cache switched on, {total} bytes held in "
        f"all (released after each; mode {mode})"
    )


class CacheCheck:
    """The check, registered by :func:`pytest_configure` when a mode other than off is asked for."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        # By id of a FixtureDef: the P.cached() contexts each live fixture entered in its setup.
        self.owned: dict[int, list[weakref.ref[Any]]] = {}
        # By id of a FixtureDef: the counter when its teardown began, and how many of the fixture's
        # holds it still owned then.
        self.teardowns: dict[int, tuple[int, int]] = {}
        # One entry per fixture setup under way: the holds owned by the fixtures set up inside it.
        self.setups: list[int] = []
        # Leaks found since the last test report; the next one reports them.
        self.found: list[Leak] = []
        # The check's own failures, reported as warnings: the check never breaks a run.
        self.troubles: list[str] = []
        # Every leak the test reports carried, for the summary (on xdist's controller, the workers').
        self.leaks: list[Leak] = []

    def pytest_report_header(self) -> str:
        return (
            f"parametrize-cache-check: {self.mode} (bnb-gc-fix; its fix is switched off for this run, "
            f"{words.VARIABLE}={_FIX_OFF}, so that the leaks show)"
        )

    @contextlib.contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        """Keep an exception raised by the check as a trouble, for the next report to warn of."""
        try:
            yield
        except Exception as error:  # The check must never break the run.
            self.troubles.append(f"the parametrize cache check failed {where}: {error!r}")

    def _claimed(self) -> set[int]:
        return {id(ref()) for refs in self.owned.values() for ref in refs}

    def _unclaimed(self) -> list[Any]:
        """The live ``P.cached()`` contexts that no fixture owns."""
        claimed = self._claimed()
        return [owner for owner in _owners() if id(owner) not in claimed]

    def _report(
        self, who: str, what: str, cause: str, after: int | None, close: Sequence[Any] = (), note: str = ""
    ) -> None:
        """Release the cache (close the contexts ``close``, and set the counter to ``after`` unless it is
        None; see :func:`_release`), then queue one leak's line, which gives the counter before and after."""
        counter = cache.counter()
        cached = cache.cached_bytes()
        after = _release(close, after)
        emptied = ""
        if after == 0:
            emptied = ", cache emptied"
        message = (
            f"{who} {what}: P._cache_enabled = {counter}{note}, {cached} bytes cached; {cause}; "
            f"{_fix_state()}. Released (counter {after}{emptied}) so later tests start clean."
        )
        self.found.append(Leak(who=who, counter=counter, cached_bytes=cached, message=message))

    def _fixture_changed(self, fixturedef: pytest.FixtureDef[Any], phase: str, change: int) -> None:
        """Report and undo what a fixture's setup or teardown did to the counter beyond the holds it owns."""
        if change == 0:
            return
        if change > 0:
            what = (
                f"left torch's parametrization cache switched on in its {phase} "
                f"(+{change} that no P.cached() context holds)"
            )
            cause = cache.CAUSE
        else:
            what = f"gave back more holds than it took in its {phase} ({change})"
            cause = _CAUSE_NEGATIVE
        self._report(_who(fixturedef), what, cause, cache.counter() - change)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]) -> Generator[None, Any, None]:
        before = cache.counter()
        # What the fixtures set up inside this one own is theirs, not this one's.
        self.setups.append(0)
        yield
        inner = self.setups.pop()
        with self._guard(f"after the setup of {_who(fixturedef)}"):
            rise = cache.counter() - before - inner
            owners: list[Any] = []
            if rise > 0:  # A hold kept on purpose has an owner that appeared with it.
                owners = self._unclaimed()[:rise]
                self.owned[id(fixturedef)] = [weakref.ref(owner) for owner in owners]
            if self.setups:
                self.setups[-1] += inner + len(owners)
            self._fixture_changed(fixturedef, "setup", rise - len(owners))
            # Finalizers run last in, first out: this one runs just before the fixture's own teardown.
            fixturedef.addfinalizer(functools.partial(self._teardown_begins, fixturedef))

    def _teardown_begins(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        with self._guard(f"before the teardown of {_who(fixturedef)}"):
            refs = self.owned.get(id(fixturedef), [])
            counter = cache.counter()
            held = sum(_suspended(ref()) for ref in refs)
            self.teardowns[id(fixturedef)] = (counter, held)

    def pytest_fixture_post_finalizer(self, fixturedef: pytest.FixtureDef[Any]) -> None:
        refs = self.owned.pop(id(fixturedef), [])
        start = self.teardowns.pop(id(fixturedef), None)
        if start is None:  # It was not set up again since its last finalisation.
            return
        with self._guard(f"after the teardown of {_who(fixturedef)}"):
            counter, held = start
            referents = (ref() for ref in refs)
            kept: list[Any] = [owner for owner in referents if _suspended(owner)]
            # Its teardown should have given back the holds it owned, except those it still keeps.
            expected = counter - held + len(kept)
            change = cache.counter() - expected
            if kept:
                what = f"still held {len(kept)} P.cached() context(s) it entered after its finalizer"
                self._report(_who(fixturedef), what, _CAUSE_KEPT, None, close=kept)
            self._fixture_changed(fixturedef, "teardown", change)

    def check(self, nodeid: str) -> None:
        """After a test's teardown, the counter must be the holds the live fixtures own, and the cache
        must be empty where that is 0; anything else is the test's leak."""
        counter = cache.counter()
        keep = sum(_suspended(ref()) for refs in self.owned.values() for ref in refs)
        empty = not getattr(cache.parametrize(), "_cache", None)
        if counter == keep and (keep != 0 or empty):
            return
        orphans: list[Any] = []
        if counter > keep:
            what = "left torch's parametrization cache switched on"
            cause = cache.CAUSE
            # A P.cached() context the test left open is closed, so that its own exit gives its hold back.
            orphans = self._unclaimed()
        elif counter < 0:
            what = "left torch's parametrization cache counter below zero"
            cause = _CAUSE_NEGATIVE
        elif counter < keep:
            what = "gave back a hold a live fixture took"
            cause = _CAUSE_NEGATIVE
        else:
            what = "left tensors in torch's parametrization cache"
            cause = _CAUSE_CACHE
        note = ""
        if keep:
            note = f" ({keep} held by live fixtures)"
        self._report(nodeid, what, cause, keep, orphans, note)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        # The report is made right after its phase; by the teardown's, every fixture that ended with this
        # test is finalised, so the test's own check runs then.
        if call.when == "teardown":
            with self._guard(f"after {item.nodeid}"):
                self.check(item.nodeid)
        found = _drain(self.found)
        troubles = _drain(self.troubles)
        outcome = yield
        report = outcome.get_result()
        _warn_troubles(item, troubles)
        if not found:
            return
        _attach(item, report, found, call.when)
        self._warn_or_fail(item, report, found)

    def _warn_or_fail(self, item: pytest.Item, report: pytest.TestReport, leaks: list[Leak]) -> None:
        """A warning per leak in warn mode, or where the phase failed already; else the phase fails.

        A warning that ``-W error`` made an error fails the phase too, unless it had failed already.
        """
        if self.mode == WARN or not report.passed:
            warned = _warned(item, leaks)
            if warned or not report.passed:
                return
        _fail(report, leaks)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "teardown":
            return
        for name, value in report.user_properties:
            if name == PROPERTY and isinstance(value, dict):
                self.leaks.append(Leak.from_property(value, at=report.nodeid))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(terminalreporter.config, "workerinput"):  # On an xdist worker: the controller reports.
            return
        # Fixtures finalised after the last test report (an interrupted run): their leaks are here only.
        self.leaks += [dataclasses.replace(leak, at=_SESSION_END) for leak in self.found]
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", "parametrize cache check")
        if not self.leaks:
            write("no test or fixture left torch's parametrization cache switched on")
            return
        for leak in self.leaks:
            write(_leak_line(leak))
        write(_total_line(self.leaks, self.mode))
