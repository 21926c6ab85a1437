"""``bnb_gc_fix.status()``: where the fix stands in this process right now, as one of three states.

Every fact of the process is read when ``status()`` is called (the libraries imported and their versions,
whether the fix is in their code now, the modules it covers, torch's counter), beside what the last
activation decided (``activation.process``). It imports nothing and never raises.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from typing import Any

import _bnb_gc_fix as startup
from _bnb_gc_fix import BITSANDBYTES, LIBRARIES, Library
from bnb_gc_fix import activation, cache, releases

# The states, worst first: where several libraries are imported, status() reports the worst.
UNPROTECTED = "unprotected"  # code that leaks this way is in use here, and the fix is not in it
PROTECTED = "protected"  # modules quantized by an affected library hold the fix's hooks
NOT_AFFECTED = "not affected"  # nothing here uses code that leaks this way, so far
STATES = (UNPROTECTED, PROTECTED, NOT_AFFECTED)


@dataclass(frozen=True)
class LibraryStatus:
    """One library that registers the leaking pair (bitsandbytes, axolotl's copy)."""

    name: str
    version: str | None  # None while it is not imported
    affected: bool | None  # its release registers the leaking pair (None: not imported, or unreadable)
    state: str  # one of STATES
    reason: str  # why, and what to do, in a sentence
    covered: int  # the modules it quantized that hold the fix's hooks


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process."""

    libraries: tuple[LibraryStatus, ...]  # bitsandbytes first
    turned_on_by: str | None  # "the start-up hook", "import bnb_gc_fix" or "activate()"; None: off
    switch: str | None  # BNB_GC_FIX as the last activation read it (None: unset)
    start_up_hook_ran: bool  # whether the start-up hook ran in this process
    counter: int | None  # torch's parametrization-cache counter (None: torch's parametrize not imported)
    cache_bytes: int | None  # what the cache holds
    held_by_the_fix: int  # how many of the counter's holds the fix's hooks keep

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

    def lines(self) -> list[str]:
        """What ``bnb-gc-fix status`` and ``print(status())`` show, a fact a line."""
        lines = [self.state_line(), self.fix_line()]
        lines.append(f"cache: {self._cache_text()}")
        lines += [_library_text(library) for library in self.libraries]
        return lines

    def state_line(self) -> str:
        return f"state: {self.state}: {self.reason}"

    def fix_line(self) -> str:
        return f"fix:   {self._fix_text()}"

    def _fix_text(self) -> str:
        switch = f"{startup.VARIABLE} unset" if self.switch is None else f"{startup.VARIABLE}={self.switch!r}"
        if self.turned_on_by is None:
            text = f"off ({switch})"
        else:
            text = f"on, turned on by {self.turned_on_by} ({switch})"
        if self.start_up_hook_ran:
            return text + "; the start-up hook ran in this process"
        return text + (
            "; the start-up hook did not run in this process (installed outside site-packages, or "
            "python -S): a process here that never imports bnb_gc_fix gets no fix (docs/reference.md: "
            "where the start-up hook cannot run)"
        )

    def _cache_text(self) -> str:
        if self.counter is None:
            return "torch's parametrization module is not imported"
        text = f"counter {self.counter}, {self.cache_bytes} bytes"
        others = self.counter - self.held_by_the_fix
        if others > 0:
            text += f"; {others} holds not taken by the fix's hooks: {cache.UNKNOWN_HOLDS}"
        return text

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _library_text(library: LibraryStatus) -> str:
    if library.version is None:
        return f"{library.name}: not imported here"
    facts = {lib.name: lib for lib in LIBRARIES}[library.name]
    leaking = f"{facts.first_affected} to before {facts.first_fixed}"
    release = {
        True: f"a release that leaks this way without the fix ({leaking})",
        False: f"a release that does not leak this way (those from {leaking} do)",
        None: "a release whose version cannot be read",
    }[library.affected]
    return f"{library.name} {library.version}: {release}; here: {library.state}"


def _held_by_the_fix() -> int:
    gate = cache.gate_if_imported()
    return 0 if gate is None else int(gate.held_by_every_thread())


def _applied(library: Library) -> bool:
    patch = sys.modules.get("bnb_gc_fix.patch")
    module = sys.modules.get(library.module)
    return patch is not None and module is not None and bool(patch.is_applied(module))


def _covered(library: Library) -> int:
    """The modules that hold the library's hook functions, with the fix's code in them, and that the fix
    took over (or takes over again at their next forward)."""
    gate = cache.gate_if_imported()
    enable = getattr(sys.modules.get(library.module), startup.ENABLE, None)
    if gate is None or enable is None or not _applied(library):
        return 0
    return int(gate.number_holding(enable))


def _where_the_fix_is(library: Library, named: str) -> tuple[str, str]:
    """The state and reason of an affected library whose module the fix went into."""
    if not _applied(library):
        return UNPROTECTED, (
            f"the functions of {library.module} are no longer the fix's (the module was imported again, or "
            "something replaced them): modules quantized from now on leak; bnb_gc_fix.activate() puts it back"
        )
    covered = _covered(library)
    late = ""
    if activation.process.decisions[library.name].late:
        late = (
            f"; {library.module} was imported before the fix turned on: modules quantized before then "
            "are taken over at their next forward"
        )
    if covered:
        return PROTECTED, f"{covered} modules quantized with {library.quantizer} hold the fix's hooks{late}"
    linear = ""
    if library is BITSANDBYTES:
        linear = (
            " (a model quantized by BitsAndBytesConfig alone holds Linear4bit layers, which never use "
            "torch's parametrization cache)"
        )
    return NOT_AFFECTED, (
        f"the fix is in {named}, but no module has been quantized with {library.quantizer} here so far"
        f"{linear}{late}"
    )


def _library_state(library: Library, version: str | None, affected: bool | None) -> tuple[str, str]:
    named = f"{library.name} {version}"
    if version is None:
        return NOT_AFFECTED, f"{library.name} is not imported in this process"
    if affected is False and not activation.process.decisions[library.name].patched:
        return NOT_AFFECTED, _not_leaking(library, named, version)
    if activation.process.turned_on_by is None:
        switch = f"{startup.VARIABLE}={activation.process.switch!r}"
        why = "deactivate()" if activation.process.deactivated else switch
        return UNPROTECTED, f"the fix is off ({why} switched it off), and {named} leaks this way"
    return _while_on(library, named)


def _not_leaking(library: Library, named: str, version: str) -> str:
    leaking = f"releases from {library.first_affected} to before {library.first_fixed} do"
    said = f"{named} does not leak this way ({leaking})"
    if not releases.fixed_upstream(library, version):
        return said
    return (
        f"{said}; what a Ctrl-C inside a forward leaves is only pointed out here (by the safety nets); "
        f"{startup.VARIABLE}=force puts the fix in, which gives it back, and pip uninstall bnb-gc-fix "
        "removes the package"
    )


def _while_on(library: Library, named: str) -> tuple[str, str]:
    """The state of an affected library's module (or a forced one) while the fix is on."""
    decision = activation.process.decisions[library.name]
    if decision.skipped is not None:
        return UNPROTECTED, f"the fix could not be put in: {decision.skipped}"
    if sys.modules.get(library.module) is None:
        return NOT_AFFECTED, (
            f"{library.module} is not imported, so nothing here has quantized a module with "
            f"{library.quantizer}; the fix goes in the moment it is imported"
        )
    if not decision.decided:
        return UNPROTECTED, (
            f"{library.module} was imported without bnb-gc-fix seeing it (an import hook in front of its "
            "own answered for it): import bnb_gc_fix before that hook is installed, or call "
            "bnb_gc_fix.activate()"
        )
    if releases.affected(library, releases.version_of(library.name)) is False:
        named += f" ({startup.VARIABLE}=force)"
    return _where_the_fix_is(library, named)


def _library_status(library: Library) -> LibraryStatus:
    version = releases.version_of(library.name)
    affected = None if version is None else releases.affected(library, version)
    state, reason = _library_state(library, version, affected)
    covered = _covered(library)
    return LibraryStatus(library.name, version, affected, state, reason, covered)


def status() -> Status:
    """Where the fix stands in this process right now. Imports nothing and never raises."""
    counter = cache.counter() if cache.parametrize() is not None else None
    cache_bytes = cache.cached_bytes() if counter is not None else None
    libraries = tuple(_library_status(library) for library in LIBRARIES)
    return Status(
        libraries=libraries,
        turned_on_by=activation.process.turned_on_by,
        switch=activation.process.switch,
        start_up_hook_ran=startup.started,
        counter=counter,
        cache_bytes=cache_bytes,
        held_by_the_fix=_held_by_the_fix(),
    )
