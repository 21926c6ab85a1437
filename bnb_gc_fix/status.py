"""``bnb_gc_fix.status()``: a read-only view of where the fix stands in this process.

Each library's state and sentence come from :meth:`bnb_gc_fix.activation.Library.now`, its verdict from
what activation recorded (``status()`` never probes, and runs no library code); torch's cache is read
without importing torch. The overall state, the JSON of ``bnb-gc-fix status --json`` and its text are
all computed from one :class:`Status`, so no two disagree.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import _bnb_gc_fix as words
from _bnb_gc_fix import BITSANDBYTES, cache, startup
from bnb_gc_fix import activation, decide, installed, notebook
from bnb_gc_fix.activation import Library, State


@dataclass(frozen=True)
class LibraryStatus:
    """Everything about one library this package patches (``_bnb_gc_fix.LIBRARIES``)."""

    name: str  # the library: "bitsandbytes", "axolotl"
    module: str  # the module whose functions are wrapped: "bitsandbytes.nn.parametrize"
    version: str | None  # its __version__; None while it is not imported
    installed: bool  # it is imported, or an import of it would find it on sys.path
    state: str  # one word, from what its module shows right now: a value of activation.State
    affected: bool | None  # its code registers the leaking plain pair (None: not known)
    probe: str | None  # what the probe of its code saw, in a few words (None: not probed)
    reason: str  # a human sentence: why it is, or is not, patched

    @property
    def patched(self) -> bool:
        return self.state == State.PATCHED.value

    def as_dict(self) -> dict[str, Any]:
        facts = {f.name: getattr(self, f.name) for f in fields(self)}
        facts["patched"] = self.patched
        return facts


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process: the libraries, and torch's cache."""

    libraries: tuple[LibraryStatus, ...]  # bitsandbytes first, then every other imported or decided on
    torch: str | None  # torch.__version__; None if torch is not imported
    counter: int | None  # torch's cache counter (above 0 after a step: the leak); None: not imported
    cache_bytes: int | None  # bytes held by torch's parametrization cache; None like counter
    mode: str  # what the last activation read BNB_GC_FIX as: auto, on, off or force
    switch: str | None  # BNB_GC_FIX as the last activation read it (None: unset)
    switch_now: str | None  # BNB_GC_FIX now: where it differs, it takes effect at the next activate()
    via: str | None  # what turned the fix on here (a VIA_* word); None where activation.turned_on() is
    #                False: nothing patched, and bitsandbytes not armed as activation recorded it (armed
    #                bitsandbytes may read `not installed` or `not needed` in state; via still shows)
    startup_hook: str  # "installed", "switched off" (by BNB_GC_FIX) or "not installed"
    cell_end_release: bool  # IPython/Jupyter: a cell ending in an exception releases the cache it held
    import_errors: Mapping[str, str] = field(default_factory=dict)  # module -> what its import raised
    torch_installed: bool = True  # torch is imported, or an import of it would find it

    @property
    def bitsandbytes(self) -> LibraryStatus:
        return self.libraries[0]

    def library(self, name: str) -> LibraryStatus | None:
        """The record of the library ``name`` ("axolotl"), or None if it is not listed."""
        for library in self.libraries:
            if library.name == name:
                return library
        return None

    @property
    def worst_library(self) -> LibraryStatus:
        """The library :attr:`state` comes from: the worst of those imported in this process (one left
        unprotected outranks one patched), else bitsandbytes."""
        imported = [library for library in self.libraries if library.version is not None]
        return min(imported or [self.bitsandbytes], key=_rank)

    @property
    def state(self) -> str:
        return self.worst_library.state

    @property
    def active(self) -> bool:
        """The library :attr:`state` comes from is patched right now (so none was unpatched since)."""
        return self.state == State.PATCHED.value

    @property
    def switch_changed(self) -> bool:
        return self.switch_now != self.switch

    @property
    def reason(self) -> str:
        return self.worst_library.reason

    def as_dict(self) -> dict[str, Any]:
        """Everything, as ``bnb-gc-fix status --json`` prints it (JSON-ready)."""
        facts: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        facts.update(
            libraries=[library.as_dict() for library in self.libraries],
            import_errors=dict(self.import_errors),
            state=self.state,
            active=self.active,
            reason=self.reason,
            switch_changed=self.switch_changed,
        )
        return facts

    def lines(self) -> list[str]:
        """The text of ``bnb-gc-fix status`` (and of ``print(status())``), a fact a line."""
        lines = [
            f"state:            {self._state_text()}",
            f"cache counter:    {_number(self.counter)}",
            f"cache bytes:      {_number(self.cache_bytes)}",
            f"BNB_GC_FIX:       {self._switch_text()}",
            f"start-up hook:    {self.startup_hook}",
            f"cell-end release: {'installed' if self.cell_end_release else _NO_RELEASE}",
            f"torch:            {self.torch or self._missing_text('torch', self.torch_installed)}",
        ]
        for library in self.libraries:
            lines += self._library_lines(library)
        listed = {library.name for library in self.libraries} | {"torch"}  # named in their own lines
        for name, problem in self.import_errors.items():
            top = name.split(".")[0]
            if top not in listed:
                lines.append(f"{top}: {problem}")
        return lines

    def _state_text(self) -> str:
        text = self.state
        if self.via and self.state in (State.PATCHED.value, State.ARMED.value):
            text += f", turned on by {_VIA_TEXT.get(self.via, self.via)}"
        if len(self.libraries) > 1:
            text += f" (from {self.worst_library.name})"
        return text

    def _switch_text(self) -> str:
        text = f"{_quoted_or_unset(self.switch)} (mode {self.mode})"
        if self.switch_changed:
            text += f"; now {_quoted_or_unset(self.switch_now)}, which takes effect at the next activate()"
        return text

    def _missing_text(self, name: str, is_installed: bool) -> str:
        """What a version-less library is: not installed, failing to import (see why), or not imported."""
        if not is_installed:
            return "(not installed)"
        if any(key.split(".")[0] == name for key in self.import_errors):
            return "(fails to import: see why)"
        return "(not imported)"

    def _library_lines(self, library: LibraryStatus) -> list[str]:
        version = library.version or self._missing_text(library.name, library.installed)
        affected = _AFFECTED_TEXT[library.affected]
        if library.probe:
            affected += f" (the probe found: {library.probe})"
        elif library.affected is not None:
            affected += " (by its version; its code was not probed)"
        return [
            f"{library.name} {version}: {library.state}",
            f"  affected:       {affected}",
            f"  why:            {library.reason}",
        ]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _rank(library: LibraryStatus) -> int:
    """Where a library's state ranks, the worst first (the order of :class:`State`)."""
    return list(State).index(State(library.state))


_NO_RELEASE = "not installed (IPython/Jupyter only)"
_AFFECTED_TEXT = {True: "yes", False: "no", None: "not known"}
_VIA_TEXT = {
    words.VIA_STARTUP_HOOK: "the start-up hook",
    words.VIA_RUNNER: "bnb-gc-fix run",
    words.VIA_IMPORT: "import bnb_gc_fix",
    words.VIA_COMMAND: "this bnb-gc-fix command",
}


def _number(value: int | None) -> str:
    if value is None:
        return "- (torch's parametrization module is not imported)"
    return str(value)


def _quoted_or_unset(value: str | None) -> str:
    if value is None:
        return "unset"
    return repr(value)


def _is_installed(name: str) -> bool:
    return not installed.absent(name)


def _library_status(library: Library) -> LibraryStatus:
    """One library's record: the state as activation says it stands now, the verdict it recorded."""
    facts = library.facts
    version = decide.library_version(facts)
    state, reason = library.now()
    verdict = library.verdict()
    if verdict is None:  # never judged: what its version says, if it is imported
        affected = decide.version_in_range(facts, version)
        probe = None
    else:
        affected = verdict.affected
        probe = verdict.probe
    return LibraryStatus(
        name=facts.name,
        module=facts.module,
        version=version,
        installed=_is_installed(facts.name),
        state=state.value,
        affected=affected,
        probe=probe,
        reason=reason,
    )


def _listed(library: Library) -> bool:
    """bitsandbytes always; another library once decided on, or imported."""
    facts = library.facts
    return facts is BITSANDBYTES or library.decided or facts.name in sys.modules


def _cache_figures() -> tuple[int | None, int | None]:
    """torch's counter and cached bytes; None for both while its parametrize is not imported."""
    if cache.parametrize() is None:
        return None, None
    try:
        return cache.counter(), cache.cached_bytes()
    except Exception:  # status() never raises
        return None, None


def _startup_hook() -> str:
    """Whether a start-up path (the start-up hook or the runner) is in place in this process."""
    if startup.installed_watcher() is not None or startup.activated_by is not None:
        return "installed"
    if startup.started_by is not None:
        return "switched off"
    return "not installed"


def status() -> Status:
    """Where the fix stands in this process right now. Never raises and imports nothing; to say whether
    a library that is not imported is installed, it reads ``sys.path``."""
    process = activation.process
    counter, cache_bytes = _cache_figures()
    listed = [library for library in process.libraries.values() if _listed(library)]
    return Status(
        libraries=tuple(_library_status(library) for library in listed),
        torch=decide.torch_version(),
        counter=counter,
        cache_bytes=cache_bytes,
        mode=process.mode,
        switch=process.switch,
        switch_now=os.environ.get(words.VARIABLE),
        via=process.via if activation.turned_on() else None,
        startup_hook=_startup_hook(),
        cell_end_release=notebook.registered(),
        import_errors=installed.failures(),
        torch_installed=_is_installed("torch"),
    )
