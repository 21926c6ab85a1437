"""``bnb_gc_fix.status()``: where the fix stands in this process right now, as one of three states.

Every fact of the process is read when ``status()`` is called (the libraries imported and their versions,
whether the fix is in their code now, the modules quantized with them, torch's counter), beside what the
activations decided (``activation.fix``). It imports nothing and never raises. One situation has
one state, whatever the switch says: a state says whether code that leaks this way is in use here.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

import _bnb_gc_fix as startup
from _bnb_gc_fix import BITSANDBYTES, LIBRARIES, Library
from bnb_gc_fix import activation, cache, census, releases
from bnb_gc_fix.lines import NOT_THE_FIXS, counted, labelled

# The states, worst first: where several libraries are imported, status() reports the worst.
UNPROTECTED = "unprotected"  # modules quantized here with a leaking library's code, the fix not in it
PROTECTED = "protected"  # the fix covers the modules quantized here with a leaking library's code
NOT_AFFECTED = "not affected"  # nothing here is quantized with code that leaks this way, so far
STATES = (UNPROTECTED, PROTECTED, NOT_AFFECTED)


@dataclass(frozen=True)
class LibraryStatus:
    """One library that registers the leaking pair (bitsandbytes, axolotl's copy)."""

    name: str
    version: str | None  # None while it is not imported
    affected: bool | None  # its release registers the leaking pair (None: not imported, or unreadable)
    state: str  # one of STATES
    reason: str  # why, and what to do, in a sentence
    covered: int  # the modules quantized with it that the fix covers


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process."""

    libraries: tuple[LibraryStatus, ...]  # bitsandbytes first
    turned_on_by: str | None  # "the start-up hook", "import bnb_gc_fix" or "activate()"; None: off
    switch: str | None  # BNB_GC_FIX as the last activation read it (None: unset)
    start_up_hook_ran: bool  # whether the start-up hook ran in this process
    deactivated: bool  # whether deactivate() switched the fix off (it stays off until activate())
    counter: int | None  # torch's parametrization-cache counter (None: torch's parametrize not imported)
    cache_bytes: int | None  # what the cache holds
    from_the_fix: int  # how many of the counter's switch-ons are the fix's own forwards'

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
        """What ``print(status())`` shows: state, fix, cache, and another library only where one is
        imported beside the one the state comes from. ``who_turned_it_on=False``: ``bnb-gc-fix``'s own
        process, where the command itself turned the fix on."""
        lines = [self.state_line(), self.fix_line(who_turned_it_on), self.cache_line()]
        others = [lib for lib in self.libraries if lib.version is not None and lib is not self.worst]
        lines += [labelled(f"{lib.name} {lib.version}", f"{lib.state}: {lib.reason}") for lib in others]
        return lines

    def state_line(self) -> str:
        return labelled("state", f"{self.state}: {self.reason}")

    def fix_line(self, who_turned_it_on: bool = True) -> str:
        switch = f"{startup.VARIABLE} unset" if self.switch is None else f"{startup.VARIABLE}={self.switch!r}"
        if self.turned_on_by is None:
            text = f"off (deactivate() switched it off; {switch})" if self.deactivated else f"off ({switch})"
        elif who_turned_it_on:
            text = f"on, turned on by {self.turned_on_by} ({switch})"
        else:
            text = f"on ({switch})"
        said_the_hook = who_turned_it_on and self.turned_on_by == activation.STARTUP_HOOK
        return labelled("fix", text + self._elsewhere_text(said_the_hook))

    def _elsewhere_text(self, said_the_hook: bool) -> str:
        """What the start-up hook means for this environment's other processes, where that is news."""
        if not self.start_up_hook_ran:
            return (
                "; the start-up hook did not run here, so a process that never imports bnb_gc_fix gets no "
                "fix (docs/reference.md: where the start-up hook cannot run)"
            )
        if self.turned_on_by is None or said_the_hook:
            return ""  # off here; or on by the start-up hook, which the line says
        return "; processes here that never import bnb_gc_fix get it too (the start-up hook runs in them)"

    def cache_line(self) -> str:
        if self.counter is None:
            return labelled("cache", "not in use (torch's parametrize module is not imported)")
        switched = "on" if self.counter else "off"
        text = f"{switched}, counter {self.counter}, {self.cache_bytes} bytes"
        others = self.counter - self.from_the_fix
        if others > 0:
            text += f"; the fix's own forwards account for {self.from_the_fix} of it: {NOT_THE_FIXS}"
        return labelled("cache", text)

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _from_the_fix() -> int:
    gate = cache.gate_if_imported()
    return 0 if gate is None else int(gate.held_by_every_thread())


def _applied(library: Library) -> bool:
    patch = sys.modules.get("bnb_gc_fix.patch")
    module = sys.modules.get(library.module_name)
    return patch is not None and module is not None and bool(patch.is_applied(module))


def _enable(library: Library) -> object:
    """The library's pre-hook function as its module has it now (None: the module is not imported)."""
    return getattr(sys.modules.get(library.module_name), startup.ENABLE, None)


def _covered(library: Library) -> int:
    """The modules quantized with the library that the fix took over (or takes over again at their next
    forward), while the fix is in the library's code."""
    gate = cache.gate_if_imported()
    enable = _enable(library)
    if gate is None or enable is None or not _applied(library):
        return 0
    return int(gate.number_holding(enable))


def _quantized_with(library: Library) -> int:
    """The modules alive that hold the library's pre-hook function now (read from every object: called only
    where the fix does not keep count of them)."""
    enable = _enable(library)
    return 0 if enable is None else len(census.modules_holding([enable], census.PRE_HOOKS))


def _nothing_quantized(library: Library) -> str:
    said = f"no module in this process has weights quantized with {library.quantizer} now"
    version = releases.version_of(library.name)
    notes = []
    if releases.affected(library, version):
        notes.append(f"only such weights leak, in {library.name} {version}")
    if library is BITSANDBYTES:
        notes.append("BitsAndBytesConfig's Linear4bit layers never use the cache")
    return f"{said} ({'; '.join(notes)})" if notes else said


def _not_leaking(library: Library, named: str, version: str) -> str:
    said = f"{named} does not leak this way (those from {library.first_affected} to before "
    said += f"{library.first_fixed} do): nothing to fix"
    if not releases.fixed_upstream(library, version):
        return said
    return (
        f"{said}. What a Ctrl-C inside a forward leaves on is only reported here (by the safety nets); "
        f"{startup.VARIABLE}=force puts the fix in, which switches it off; pip uninstall bnb-gc-fix "
        "removes the package"
    )


def _why_the_fix_is_not_in(library: Library) -> str:
    """Why the fix is not in the library's code now, and what puts it in."""
    fix = activation.fix
    decision = fix.decisions[library.name]
    if fix.turned_on_by is None:
        if fix.deactivated:
            return "the fix is off (deactivate() switched it off; bnb_gc_fix.activate() switches it on)"
        return f"the fix is off ({startup.VARIABLE}={fix.switch!r}; unset it to turn the fix on)"
    if decision.skipped is not None:
        return f"the fix could not be put in: {decision.skipped}"
    if not decision.decided:
        return (
            f"{library.module_name} was imported where bnb-gc-fix could not see it (an import hook in front "
            "of its own): import bnb_gc_fix before that hook is installed, or call bnb_gc_fix.activate()"
        )
    return (
        f"{library.module_name} was imported again where bnb-gc-fix could not see it: "
        "bnb_gc_fix.activate() puts the fix back in"
    )


def _where_the_fix_is_not(library: Library) -> tuple[str, str, int]:
    why = _why_the_fix_is_not_in(library)
    leaking = _quantized_with(library)
    if leaking:
        verb = "leaks" if leaking == 1 else "leak"
        quantized = f"{counted(leaking, 'module')} quantized here with {library.quantizer}"
        return UNPROTECTED, f"{quantized} {verb} this way: {why}", 0
    return NOT_AFFECTED, f"{_nothing_quantized(library)}. Weights quantized that way would leak: {why}", 0


def _where_the_fix_is(library: Library) -> tuple[str, str, int]:
    covered = _covered(library)
    if covered == 0 and activation.fix.decisions[library.name].late:
        # quantized before the fix turned on: each is covered at its next forward
        covered = _quantized_with(library)
    if covered:
        quantized = f"{counted(covered, 'module')} quantized here with {library.quantizer}"
        return PROTECTED, f"the fix covers {quantized}", covered
    return NOT_AFFECTED, _nothing_quantized(library), 0


def _library_state(library: Library, version: str | None) -> tuple[str, str, int]:
    """The library's state, why, and how many modules quantized with it the fix covers."""
    if version is None:
        return NOT_AFFECTED, f"{library.name} is not imported in this process", 0
    named = f"{library.name} {version}"
    if releases.affected(library, version) is False and not activation.fix.decisions[library.name].patched:
        return NOT_AFFECTED, _not_leaking(library, named, version), 0
    if sys.modules.get(library.module_name) is None and activation.fix.turned_on_by is not None:
        return NOT_AFFECTED, _nothing_quantized(library), 0
    if _applied(library):
        return _where_the_fix_is(library)
    return _where_the_fix_is_not(library)


def _library_status(library: Library) -> LibraryStatus:
    version = releases.version_of(library.name)
    affected = None if version is None else releases.affected(library, version)
    state, reason, covered = _library_state(library, version)
    return LibraryStatus(library.name, version, affected, state, reason, covered)


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
        deactivated=activation.fix.deactivated,
        counter=counter,
        cache_bytes=cache_bytes,
        from_the_fix=_from_the_fix(),
    )
