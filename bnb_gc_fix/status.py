"""``bnb_gc_fix.status()``: where the fix stands in this process right now, as one of three states.

Every fact is read when ``status()`` is called (the libraries imported and their versions, what their code
was read to do, the module objects the fix decided for, the modules quantized with them, torch's counter),
beside what the activations decided (``activation.fix``); ``bnb_gc_fix.verdict`` judges them. The same
facts, asked about a job here (:func:`for_a_job`), are ``bnb-gc-fix status``'s answer. Imports nothing
of the user's and never raises.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

import _bnb_gc_fix as startup
from bnb_gc_fix import activation, cache, census, cover, ledger, verdict
from bnb_gc_fix.installed import has_module
from bnb_gc_fix.libraries import BITSANDBYTES, LIBRARIES, Library
from bnb_gc_fix.lines import counted, labelled, possessive
from bnb_gc_fix.releases import version_of
from bnb_gc_fix.verdict import NOT_AFFECTED, PROTECTED, STATES, UNPROTECTED, Facts, Hooks, LibraryStatus

if TYPE_CHECKING:
    from bnb_gc_fix.reading import Reading

__all__ = ["NOT_AFFECTED", "PROTECTED", "STATES", "UNPROTECTED", "LibraryStatus", "Status", "status"]

#: Advice that holds wherever it is given: reset() inside an open ``P.cached()`` block leaves the counter
#: at -1 when the block ends, and the cache on for good.
RESET_ADVICE = "bnb_gc_fix.reset() switches it off, once no forward runs and no P.cached() block is open"


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process (or, from :func:`for_a_job`, for a job here)."""

    libraries: tuple[LibraryStatus, ...]  # bitsandbytes first
    asked_by: str | None  # who asked for the fix: "the start-up hook", "import bnb_gc_fix", "activate()"
    switch: str | None  # BNB_GC_FIX as the last activation read it (None: unset)
    start_up_hook_ran: bool  # whether the start-up hook ran in this process
    counter: int | None  # torch's parametrization-cache counter (None: torch's parametrize not imported)
    cache_bytes: int | None  # what the cache holds
    from_the_fix: int  # how many of the counter's switch-ons are the fix's own forwards', on every thread
    left_here: int  # of those, this thread's that no running call holds (a Ctrl-C left them)

    @property
    def worst(self) -> LibraryStatus:
        """The library the state comes from: the worst of those imported, else bitsandbytes."""
        imported = [library for library in self.libraries if library.version is not None]
        return min(imported or self.libraries[:1], key=lambda library: STATES.index(library.state))

    @property
    def state(self) -> str:
        return self.worst.state

    @property
    def reason(self) -> str:
        return self.worst.reason

    @property
    def fixed(self) -> bool:
        """Whether the fix is in a library's hooks here."""
        return any(library.fixed for library in self.libraries)

    @property
    def covered(self) -> int:
        return sum(library.covered for library in self.libraries)

    def as_dict(self) -> dict[str, Any]:
        """Everything, as ``bnb-gc-fix status --json`` prints it."""
        facts = asdict(self)
        facts.update(state=self.state, reason=self.reason, fixed=self.fixed, covered=self.covered)
        return facts

    def library(self, name: str) -> LibraryStatus:
        return next(library for library in self.libraries if library.name == name)

    def lines(self, everywhere: bool = False) -> list[str]:
        """What ``print(status())`` shows: state, fix, cache, and another library only where one is
        imported beside the one the state comes from; ``everywhere``: ``bnb-gc-fix status``'s, for this
        environment's processes (no cache line: the command's own process trains nothing)."""
        lines = [self.state_line(), self.fix_line(everywhere)]
        lines += [] if everywhere else [self.cache_line()]
        others = [lib for lib in self.libraries if lib.version is not None and lib is not self.worst]
        lines += [labelled(f"{lib.name} {lib.version}", f"{lib.state}: {lib.reason}") for lib in others]
        return lines

    def state_line(self) -> str:
        return labelled("state", f"{self.state}: {self.reason}")

    def fix_line(self, everywhere: bool = False) -> str:
        """Whether the fix is in the libraries' hooks here; ``everywhere``: in this environment's processes
        (``bnb-gc-fix``'s own process, where the command imported the libraries)."""
        return labelled("fix", f"{_fix_text(self)}{_elsewhere(self, everywhere)}")

    def cache_line(self) -> str:
        if self.counter is None:
            return labelled("cache", "not in use (torch's parametrize module is not imported)")
        text = f"{'on' if self.counter else 'off'}, counter {self.counter}, {self.cache_bytes} bytes"
        if self.left_here:
            text += f"; {counted(self.left_here, 'switch-on')} of it left by a Ctrl-C inside a forward here: "
            text += "that layer's next forward switches it off, or bnb_gc_fix.reset()"
        if self.counter - self.from_the_fix > 0:
            text += f"; {self.who_keeps_it_on()}"
        return labelled("cache", text)

    def who_keeps_it_on(self) -> str:
        """What keeps the cache on beyond the fix's own forwards: modules that leak this way first, else
        what may (a Ctrl-C in hooks the fix is not in and that do not need it, an open P.cached() block,
        a forward on another thread), and when reset() is safe."""
        leaking = [library for library in self.libraries if library.leaking]
        if leaking:
            return "left on by " + " and ".join(_leaking_through(self, library) for library in leaking)
        causes = [
            f"a Ctrl-C inside a forward of {possessive(f'{library.name} {library.version}')} own hooks"
            for library in self.libraries
            if library.hooks == Hooks.DO_NOT_LEAK.value and not library.fixed
        ]
        causes += [
            "a P.cached() block still open",
            "a forward running on another thread or begun before the fix was on",
        ]
        said = f"bnb-gc-fix cannot tell what else switched it on ({'; '.join(causes)}). If nothing keeps it "
        said += f"on on purpose, {RESET_ADVICE}"
        if self.from_the_fix:
            said = f"the fix's own forwards account for {self.from_the_fix} of it; {said}"
        return said

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _fix_text(status: Status) -> str:
    """The fix line's one fact: whether the fix is in the hooks of the libraries imported here."""
    switch = f"{startup.VARIABLE} unset" if status.switch is None else f"{startup.VARIABLE}={status.switch!r}"
    if status.asked_by is None:
        return f"off ({switch})"
    imported = [library for library in status.libraries if library.hooks is not None]
    if not imported:
        where = f"at the import of {BITSANDBYTES.module_name}, where they leak"
        return f"goes into {possessive(BITSANDBYTES.name)} hooks {where} ({switch})"
    if all(library.hooks == Hooks.DO_NOT_LEAK.value and not library.fixed for library in imported):
        named = " and ".join(f"{library.name} {library.version}" for library in imported)
        return f"not needed here: the hooks of {named} do not leak this way ({switch})"
    fixed = [_hooks_of(library) for library in imported if library.fixed]
    not_in = [_hooks_of(lib) for lib in imported if not lib.fixed and lib.hooks != Hooks.DO_NOT_LEAK.value]
    said = [f"in {' and '.join(fixed)}"] if fixed else []
    said += [f"not in {' and '.join(not_in)}: the state says why"] if not_in else []
    return f"{'; '.join(said)} ({switch})"


def _hooks_of(library: LibraryStatus) -> str:
    return f"{possessive(f'{library.name} {library.version}')} hooks"


def _elsewhere(status: Status, everywhere: bool) -> str:
    """What the start-up hook means for this environment's other processes, where that is news."""
    if status.asked_by is None:
        return ""
    if not status.start_up_hook_ran:
        return (
            "; the start-up hook did not run here, so a process that never imports bnb_gc_fix gets no "
            "fix (docs/reference.md: where the start-up hook cannot run)"
        )
    if everywhere and status.fixed:
        return "; the start-up hook does the same in every process here"
    return ""


def _leaking_through(status: Status, library: LibraryStatus) -> str:
    """What leaks the library's modules run: its own hooks, or, with the fix in them, modules the fix
    cannot cover."""
    if library.fixed:
        modules = counted(library.leaking, "module")
        return (
            f"{modules} quantized here with {library.name} that the fix cannot cover (another tool's "
            "function in front of their pre-hooks)"
        )
    why = "the fix is off" if status.asked_by is None else "the fix is not in them"
    return f"{possessive(library.name)} own hooks ({why})"


# --- the facts ------------------------------------------------------------------------------------------
def _why_not_in(library: Library, decision: activation.Decision, decided: bool) -> str:
    """Why the fix is not in the library's hooks now, and what puts it in; where it is in them, why modules
    quantized with it run without it."""
    fix = activation.fix
    if fix.asked_by is None:
        return f"the fix is off ({startup.VARIABLE}={fix.switch!r}; unset it to turn the fix on)"
    if decided and decision.fixed:  # its modules run without it only where it cannot cover them
        return (
            f"the fix is in {possessive(library.name)} hooks, but another function stands in the place of "
            "their pre-hook (another tool's), so the fix cannot cover them"
        )
    if decision.module is None:
        return (
            f"{library.module_name} was imported where bnb-gc-fix could not see it (an import hook in front "
            "of its own): import bnb_gc_fix before that hook is installed, or call bnb_gc_fix.activate()"
        )
    if not decided:
        return (
            f"{library.module_name} was imported again where bnb-gc-fix could not see it: "
            "bnb_gc_fix.activate() puts the fix back in"
        )
    return f"the fix could not be put in: {decision.why_not}"


def _absent(library: Library, job: bool) -> str | None:
    """Why the library's module is not imported where the library is: its release has none, or (for a job:
    the command imported what is installed) it fails to import."""
    package = library.module_name.rpartition(".")[0]
    if (job or package in sys.modules) and not has_module(library.module_name):
        return "no module"
    return "fails" if job else None


def _read(library: Library, module: ModuleType | None, decided: bool) -> Reading | None:
    """What the library's code was read to do: as the fix decided for its module, else read now."""
    if module is None:
        return None
    if decided:
        return activation.fix.decisions[library.name].reading
    from bnb_gc_fix import reading  # imports torch, imported already where a library's module is

    return reading.read(library, module)


def _facts(library: Library, job: bool) -> Facts:
    version = version_of(library.name)
    module = sys.modules.get(library.module_name)
    decision = activation.fix.decisions[library.name]
    decided = activation.fix.asked_by is not None and activation.decided_for(library, module)
    absent = _absent(library, job) if module is None and version is not None else None
    what = _read(library, module, decided)
    facts = Facts(
        library=library,
        version=version,
        hooks=None if what is None else what.hooks,
        said="" if what is None else what.said,
        always_off=what is not None and what.hooks is Hooks.DO_NOT_LEAK and what.pair is not None,
        fixed=decided and decision.fixed,
        why_not=_why_not_in(library, decision, decided),
        absent=absent,
        job=job,
    )
    return _counted(facts, module is not None)


def _counted(facts: Facts, imported: bool) -> Facts:
    """The facts with this process's modules counted (none for a job: the verdict answers for its own)."""
    library = facts.library
    needs_the_fix = facts.hooks is not Hooks.DO_NOT_LEAK or facts.fixed
    if not imported or not needs_the_fix or facts.job:
        return facts
    if not facts.fixed:
        return replace(facts, leaking=census.quantized_with(library.module_name))
    return replace(
        facts,
        covered=cover.number_covered(library.name),
        at_next_forward=cover.number_awaiting(census.noted(library.module_name)),
        leaking=cover.number_uncoverable(library.name),
    )


def _status(job: bool) -> Status:
    counter = cache.counter() if cache.parametrize() is not None else None
    return Status(
        libraries=tuple(verdict.judged(_facts(library, job)) for library in LIBRARIES),
        asked_by=activation.fix.asked_by,
        switch=activation.fix.switch,
        start_up_hook_ran=startup.started,
        counter=counter,
        cache_bytes=cache.cached_bytes() if counter is not None else None,
        from_the_fix=ledger.count_every_thread(),
        left_here=ledger.left_here(cover.covered_module),
    )


def status() -> Status:
    """Where the fix stands in this process right now. Imports nothing of the user's and never raises."""
    return _status(job=False)


def for_a_job() -> Status:
    """What a job in this environment that quantizes with each library imported here gets: ``bnb-gc-fix
    status``'s answer (the command imports the libraries first)."""
    return _status(job=True)
