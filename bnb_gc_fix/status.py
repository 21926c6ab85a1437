"""``bnb_gc_fix.status()``: each library's state (:mod:`bnb_gc_fix.activation`), what its module shows
right now, and torch's cache, read without importing or raising. The overall state, the JSON of
``bnb-gc-fix status --json`` and its text are all computed from one :class:`Status`, so no two disagree.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import _bnb_gc_fix_boot as boot
import _bnb_gc_fix_cache as cache
from bnb_gc_fix import activation, decide, installed, notebook
from bnb_gc_fix.activation import Library, State
from bnb_gc_fix.targets import BITSANDBYTES

PATCHED, UNPATCHED, ARMED, NOT_NEEDED, OFF, SKIPPED = (state.value for state in State)


@dataclass(frozen=True)
class LibraryStatus:
    """Everything about one library this package patches (see :mod:`bnb_gc_fix.targets`)."""

    name: str  # the library: "bitsandbytes", "axolotl"
    module: str  # the module whose functions are wrapped: "bitsandbytes.nn.parametrize"
    version: str | None  # its __version__; None while it is not imported
    state: str  # one word, from what its module shows right now: a value of activation.State
    affected: bool | None  # its code registers the leaking plain pair (None: not known, not imported)
    probe: str | None  # what the probe of its code saw, in a few words (None: not probed)
    reason: str  # a human sentence: why it is, or is not, patched

    @property
    def patched(self) -> bool:
        return self.state == PATCHED

    def as_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "patched": self.patched}


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
    via: str | None  # "start-up hook", "runner", "import" or "activate()"; None: nothing patched or armed
    startup_hook: str  # "installed", "switched off" (by BNB_GC_FIX) or "not installed"
    cell_end_release: bool  # IPython/Jupyter: a cell ending in an exception releases the cache it held
    gil: bool = True  # False on a free-threaded Python without the GIL (untested; reason says so)
    import_errors: Mapping[str, str] = field(default_factory=dict)  # module -> what its import raised

    @property
    def bitsandbytes(self) -> LibraryStatus:
        return self.libraries[0]

    def library(self, name: str) -> LibraryStatus | None:
        """The record of the library ``name`` ("axolotl"), or None if it is not listed."""
        return next((library for library in self.libraries if library.name == name), None)

    @property
    def deciding(self) -> LibraryStatus:
        """The library :attr:`state` comes from: one unpatched since, else one patched, else bitsandbytes."""
        for wanted in (UNPATCHED, PATCHED):
            for library in self.libraries:
                if library.state == wanted:
                    return library
        return self.bitsandbytes

    @property
    def state(self) -> str:
        return self.deciding.state

    @property
    def active(self) -> bool:
        """Some library is patched right now."""
        return self.state == PATCHED

    @property
    def switch_changed(self) -> bool:
        return self.switch_now != self.switch

    @property
    def reason(self) -> str:
        return self.deciding.reason if self.gil else f"{self.deciding.reason}. {UNTESTED_FREE_THREADING}"

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
        state = self.state
        if self.via and state in (PATCHED, ARMED):
            state += f", turned on by {_VIA.get(self.via, self.via)}"
        if len(self.libraries) > 1:
            state += f" (from {self.deciding.name})"
        lines = [f"state:            {state}"]
        if not self.gil:
            lines.append(f"  {UNTESTED_FREE_THREADING}")
        switch = f"{'unset' if self.switch is None else repr(self.switch)} (mode {self.mode})"
        if self.switch_changed:
            now = "unset" if self.switch_now is None else repr(self.switch_now)
            switch += f"; now {now}, which takes effect at the next activate()"
        lines += [
            f"cache counter:    {_number(self.counter)}",
            f"cache bytes:      {_number(self.cache_bytes)}",
            f"BNB_GC_FIX:       {switch}",
            f"start-up hook:    {self.startup_hook}",
            f"cell-end release: {'installed' if self.cell_end_release else _NO_RELEASE}",
            f"torch:            {self.torch or _missing('torch', self.import_errors)}",
        ]
        for library in self.libraries:
            version = library.version or _missing(library.name, self.import_errors)
            lines.append(f"{library.name} {version}: {library.state}")
            affected = {True: "yes", False: "no", None: "not known"}[library.affected]
            if library.probe:
                affected += f" (the probe found: {library.probe})"
            lines += [f"  affected:       {affected}", f"  why:            {library.reason}"]
        listed = {library.name for library in self.libraries} | {"torch"}  # named in their own lines
        for name, problem in self.import_errors.items():
            if name.split(".")[0] not in listed:
                lines.append(f"{name.split('.')[0]}: {problem}")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


UNTESTED_FREE_THREADING = (
    "Caution: this Python runs without the GIL (a free-threaded build); the fix then gates with "
    "a lock, a path never tested on such a build"
)

_NO_RELEASE = "not installed (IPython/Jupyter only)"
_VIA = {"start-up hook": "the start-up hook", "runner": "bnb-gc-fix run", "import": "import bnb_gc_fix"}


def _number(value: int | None) -> str:
    return "- (torch's parametrization module is not imported)" if value is None else str(value)


def _missing(name: str, errors: Mapping[str, str]) -> str:
    """What a version-less library is: not installed, failing to import (see why), or not imported."""
    if any(key.split(".")[0] == name for key in errors):
        return "(not installed)" if installed.missing(name) else "(fails to import: see why)"
    return "(not imported)"


def _state(library: Library, version: str | None) -> tuple[State, str]:
    """One library's state and sentence, from what its module shows right now."""
    state = library.state
    if state is State.PATCHED and not library.applied():
        return State.UNPATCHED, (
            f"{library.target.module} was reloaded or imported again after it was patched, so its own "
            "functions are back and nothing is patched now; bnb_gc_fix.activate() patches it again"
        )
    if state is State.ARMED and library.target is BITSANDBYTES:
        if version is not None and decide.before_parametrize(version):  # it will never import parametrize
            return State.NOT_NEEDED, f"{decide.no_parametrize(version)}; nothing to patch"
        return state, _armed_reason(version) or library.reason
    return state, library.reason


def _armed_reason(bnb: str | None) -> str | None:
    """A truer sentence than "armed" when what the patch waits for failed to import, or is not installed."""
    failed = installed.failures()
    for name in ("torch", "bitsandbytes", decide.PARAMETRIZE):
        if name in failed and name not in sys.modules:
            return f"{failed[name]}; nothing to patch"
    if bnb is not None or "bitsandbytes" in sys.modules:
        return None
    from importlib.machinery import PathFinder

    if PathFinder.find_spec("bitsandbytes") is None:
        return (
            "armed: bitsandbytes is not installed, so there is nothing to patch now; the fix "
            "checks and patches it if it is imported later"
        )
    return None


def _library(library: Library) -> LibraryStatus:
    version = library.target.version()
    verdict = library.verdict(activation.process.mode)
    affected, probe = (None, None) if verdict is None else (verdict.affected, verdict.probe)
    state, reason = _state(library, version)
    target = library.target
    return LibraryStatus(target.name, target.module, version, state.value, affected, probe, reason)


def status() -> Status:
    """Where the fix stands in this process right now (never imports anything, never raises)."""
    process = activation.process
    counter: int | None = None
    cache_bytes: int | None = None
    if cache.parametrize() is not None:  # else torch's parametrize is not imported: nothing to read
        with contextlib.suppress(Exception):  # status() never raises
            counter, cache_bytes = cache.counter(), cache.cached_bytes()
    via = process.via if activation.on() else None
    if via == "import" and boot.trigger:  # credited to the start-up hook or the runner only if its finder
        via = boot.trigger  # fired (another import hook in front of it can hide bitsandbytes' import)
    hook = "switched off" if boot.started_by is not None else "not installed"
    if boot.installed_watcher() is not None or boot.trigger is not None:
        hook = "installed"
    return Status(
        libraries=tuple(
            _library(library)
            for library in process.libraries.values()
            if library.target is BITSANDBYTES or library.decided or library.target.name in sys.modules
        ),
        torch=decide.torch_version(),
        counter=counter,
        cache_bytes=cache_bytes,
        mode=process.mode,
        switch=process.switch,
        switch_now=os.environ.get(boot.VARIABLE),
        via=via,
        startup_hook=hook,
        cell_end_release=notebook.installed(),
        gil=cache.gil_enabled(),
        import_errors=installed.failures(),
    )
