"""``bnb_gc_fix.status()``: where the fix stands in this process right now, as one of three states.

Every fact of the process is read when ``status()`` is called (the libraries imported and their versions,
the module objects the fix decided for, the modules quantized with them, torch's counter), beside what
the activations decided (``activation.fix``). It imports nothing and never raises. One situation has one
state, whatever the switch says: a state says whether code that leaks this way is in use here. The words
it says them in are ``status_lines.py``'s.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import _bnb_gc_fix as startup
from bnb_gc_fix import activation, cache, census, cover, ledger, releases, status_lines
from bnb_gc_fix.installed import has_module
from bnb_gc_fix.libraries import LIBRARIES, Library
from bnb_gc_fix.lines import possessive

# The states, worst first: where several libraries are imported, status() reports the worst.
UNPROTECTED = "unprotected"  # modules quantized here with a leaking library's code, the fix not in it
PROTECTED = "protected"  # the fix covers the modules quantized here with a leaking library's code
NOT_AFFECTED = "not affected"  # nothing here is quantized with code that leaks this way, so far
STATES = (UNPROTECTED, PROTECTED, NOT_AFFECTED)


class _Stated(Protocol):
    """A library with a state: a LibraryStatus, or ``bnb-gc-fix status``'s answer for one."""

    @property
    def version(self) -> str | None: ...

    @property
    def state(self) -> str: ...


Stated = TypeVar("Stated", bound=_Stated)


def worst_of(libraries: tuple[Stated, ...]) -> Stated:
    """The one a state comes from: the worst of the libraries imported, else the first (bitsandbytes)."""
    imported = [library for library in libraries if library.version is not None]
    return min(imported or libraries[:1], key=lambda library: STATES.index(library.state))


@dataclass(frozen=True)
class LibraryStatus:
    """One library that may register the leaking pair (bitsandbytes, axolotl's copy)."""

    name: str
    version: str | None  # None while it is not imported
    affected: bool | None  # its hooks, as imported now, were read to leak this way (None: not read)
    fixed: bool  # the fix is in its hooks now
    state: str  # one of STATES
    reason: str  # why, and what to do, in a sentence
    covered: int  # the modules quantized with it that the fix covers
    at_next_forward: int  # those quantized with it before the fix went in: it covers each at its next forward
    leaking: int  # the modules quantized with it that run without the fix and leak this way


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process."""

    libraries: tuple[LibraryStatus, ...]  # bitsandbytes first
    turned_on_by: str | None  # "the start-up hook", "import bnb_gc_fix" or "activate()"; None: off
    switch: str | None  # BNB_GC_FIX as the activation that turned the fix on read it (None: unset)
    start_up_hook_ran: bool  # whether the start-up hook ran in this process
    watching: tuple[str, ...]  # the libraries' modules it still waits for here (none imported yet)
    counter: int | None  # torch's parametrization-cache counter (None: torch's parametrize not imported)
    cache_bytes: int | None  # what the cache holds
    from_the_fix: int  # how many of the counter's switch-ons are the fix's own forwards'

    @property
    def worst(self) -> LibraryStatus:
        """The library the state comes from: the worst of those imported, else bitsandbytes."""
        return worst_of(self.libraries)

    @property
    def state(self) -> str:
        return self.worst.state

    @property
    def reason(self) -> str:
        return self.worst.reason

    @property
    def on(self) -> bool:
        return self.turned_on_by is not None

    @property
    def covered(self) -> int:
        return sum(library.covered for library in self.libraries)

    def as_dict(self) -> dict[str, Any]:
        """Everything, as ``bnb-gc-fix status --json`` prints it."""
        facts = asdict(self)
        facts.update(state=self.state, reason=self.reason, on=self.on, covered=self.covered)
        return facts

    def library(self, name: str) -> LibraryStatus:
        return next(library for library in self.libraries if library.name == name)

    def lines(self, who_turned_it_on: bool = True) -> list[str]:
        """What ``print(status())`` shows (``bnb_gc_fix.status_lines``). ``who_turned_it_on=False``:
        ``bnb-gc-fix``'s own process, where the command itself turned the fix on."""
        return status_lines.lines(self, who_turned_it_on)

    def state_line(self) -> str:
        return status_lines.state_line(self)

    def fix_line(self, who_turned_it_on: bool = True) -> str:
        return status_lines.fix_line(self, who_turned_it_on)

    def who_keeps_it_on(self) -> str:
        return status_lines.who_keeps_it_on(self)

    def __str__(self) -> str:
        return "\n".join(self.lines())


# --- one library's state ---------------------------------------------------------------------------------
class _Found(NamedTuple):
    state: str
    reason: str
    covered: int = 0
    at_next_forward: int = 0
    leaking: int = 0


def _cross_check(library: Library, version: str, leaks: bool) -> str:
    """Where the release number says otherwise than what the library's code was read to do, a clause that
    says so (else nothing)."""
    by_number = releases.in_the_leaking_range(library, version)
    if by_number is None or by_number == leaks:
        return ""
    releases_named = f"releases {library.first_affected} to before {library.first_fixed}"
    if leaks:
        return f" ({library.name} {version} does, though only {releases_named} did)"
    return f" ({library.name} {version} does not, though {releases_named} do)"


def _without_the_fix(library: Library, why: str) -> _Found:
    """Where the fix is not in the library's code: the modules that leak decide the state."""
    leaking = census.leaking_modules(library.module_name)
    if leaking:
        return _Found(UNPROTECTED, f"{status_lines.leak_this_way(library, leaking)}: {why}", leaking=leaking)
    said = f"no module quantized here with {library.quantizer_name} leaks this way now. Weights quantized "
    said += f"that way would run without the fix: {why}"
    return _Found(NOT_AFFECTED, said)


def _read_to_leak(decision: activation.Decision) -> bool | None:
    """Whether the library's hooks were read to leak this way (None: not read, or unreadable)."""
    return None if decision.reading is None else decision.reading.leaks


def _said(decision: activation.Decision) -> str:
    return "" if decision.reading is None else decision.reading.said


def _with_the_fix(library: Library, version: str, decision: activation.Decision) -> _Found:
    uncoverable = cover.number_uncoverable(library.name)
    if uncoverable:
        said = f"{status_lines.leak_this_way(library, uncoverable)}: the fix is in "
        said += f"{possessive(library.name)} hooks, but another function stands in the place of its pre-hook "
        said += "there (another tool's), so the fix cannot cover them"
        return _Found(UNPROTECTED, said, leaking=uncoverable)
    covered = cover.number_covered(library.name)
    at_next_forward = cover.number_awaiting(library.name, census.noted(library.module_name))
    checked = _cross_check(library, version, leaks=True) if _read_to_leak(decision) else ""
    if covered or at_next_forward:
        said = f"{status_lines.covering(library, covered, at_next_forward)}{checked}"
        return _Found(PROTECTED, said, covered=covered, at_next_forward=at_next_forward)
    leaking_release = version if _read_to_leak(decision) else None
    return _Found(NOT_AFFECTED, f"{status_lines.nothing_quantized(library, leaking_release)}{checked}")


def _not_needed(library: Library, version: str, decision: activation.Decision) -> _Found:
    checked = _cross_check(library, version, leaks=False)
    if decision.reading is None or not decision.reading.always_off:  # its hooks never switch the cache
        return _Found(NOT_AFFECTED, f"{_said(decision)}{checked}: nothing of this leak")
    named = possessive(f"{library.name} {version}")
    ctrl_c = (
        "A Ctrl-C inside a forward still leaves the cache on: a notebook cell's end reports it; "
        f"{startup.VARIABLE}=force puts the fix into these hooks too, and the layer's next forward then "
        "switches the cache off"
    )
    said = f"{named} hooks switch the cache off even when a forward raises{checked}: nothing to fix. {ctrl_c}"
    return _Found(NOT_AFFECTED, said)


def _waiting(library: Library) -> _Found:
    """Where the fix reads the library's register function on the first module it quantizes."""
    reads = f"the fix reads what {library.register_name}() registers on the next module it quantizes, "
    reads += "and goes in there where it leaks"
    leaking = census.leaking_modules(library.module_name, census.noted(library.module_name))
    if leaking:
        said = f"{status_lines.leak_this_way(library, leaking)}, quantized before that: {reads}"
        return _Found(UNPROTECTED, said, leaking=leaking)
    return _Found(NOT_AFFECTED, f"{status_lines.nothing_quantized(library)}; {reads}")


def _why_the_fix_is_not_in(library: Library, decision: activation.Decision) -> str:
    """Why the fix is not in the library's code now, and what puts it in."""
    fix = activation.fix
    if fix.turned_on_by is None:
        return f"the fix is off ({status_lines.switched_off_by(fix.switch)})"
    if decision.module is None:
        return (
            f"{library.module_name} was imported where bnb-gc-fix could not see it (an import hook in front "
            "of its own): import bnb_gc_fix before that hook is installed, or call bnb_gc_fix.activate()"
        )
    if not activation.decided_for(library, sys.modules.get(library.module_name)):
        return (
            f"{library.module_name} was imported again where bnb-gc-fix could not see it: "
            "bnb_gc_fix.activate() puts the fix back in"
        )
    if decision.why_not is not None:
        return f"the fix could not be put in: {decision.why_not}"
    return f"bnb-gc-fix cannot read what its hooks do: {_said(decision)}"


def _decided_here(library: Library) -> activation.Decision | None:
    """What the fix decided for the library's module as it is imported now (None: nothing, or for a module
    object no longer imported, or the fix is off)."""
    module = sys.modules.get(library.module_name)
    if activation.fix.turned_on_by is None or module is None or not activation.decided_for(library, module):
        return None
    return activation.fix.decisions[library.name]


def _release_without_the_module(library: Library) -> bool:
    """Whether the library's release has no such module (one from before the leak), where its package is
    imported (nothing is imported to tell)."""
    package = library.module_name.rpartition(".")[0]
    return package in sys.modules and not has_module(library.module_name)


def _not_imported(library: Library, version: str | None) -> _Found:
    """Where the library, or its module, is not imported."""
    if version is None:
        return _Found(NOT_AFFECTED, f"{library.name} is not imported in this process")
    if _release_without_the_module(library):
        return _Found(NOT_AFFECTED, status_lines.no_module(library, version))
    return _Found(NOT_AFFECTED, status_lines.nothing_quantized(library))


def _found(library: Library, version: str | None) -> _Found:
    if version is None or sys.modules.get(library.module_name) is None:
        return _not_imported(library, version)
    decision = _decided_here(library)
    if decision is not None and decision.outcome == activation.Outcome.PENDING:
        return _waiting(library)
    if decision is not None and decision.outcome == activation.Outcome.FIXED:
        return _with_the_fix(library, version, decision)
    if decision is not None and decision.outcome == activation.Outcome.NOT_NEEDED:
        return _not_needed(library, version, decision)
    return _without_the_fix(library, _why_the_fix_is_not_in(library, activation.fix.decisions[library.name]))


def _library_status(library: Library) -> LibraryStatus:
    version = releases.version_of(library.name)
    found = _found(library, version)
    decision = _decided_here(library)
    affected = None if decision is None else _read_to_leak(decision)
    fixed = decision is not None and decision.outcome == activation.Outcome.FIXED
    return LibraryStatus(
        name=library.name,
        version=version,
        affected=affected,
        fixed=fixed,
        state=found.state,
        reason=found.reason,
        covered=found.covered,
        at_next_forward=found.at_next_forward,
        leaking=found.leaking,
    )


def status() -> Status:
    """Where the fix stands in this process right now. Imports nothing and never raises."""
    counter = cache.counter() if cache.parametrize() is not None else None
    cache_bytes = cache.cached_bytes() if counter is not None else None
    libraries = tuple(_library_status(library) for library in LIBRARIES)
    return Status(
        libraries=libraries,
        turned_on_by=activation.fix.turned_on_by,
        switch=activation.fix.switch,
        start_up_hook_ran=startup.started,
        watching=tuple(name for name in startup.WATCHED if startup.started and name not in sys.modules),
        counter=counter,
        cache_bytes=cache_bytes,
        from_the_fix=ledger.count_every_thread(),
    )
