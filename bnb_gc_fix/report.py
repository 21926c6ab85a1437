"""What ``bnb_gc_fix.status()`` returns: one record per library, and the process around them.

Every fact is stored once. A :class:`LibraryStatus` holds everything about one library
(bitsandbytes, axolotl, ...); :class:`Status` holds the libraries and the process-level facts (torch's
cache, the switch, how the fix was turned on). Everything else -- the overall :attr:`Status.state`,
:attr:`Status.active`, :attr:`Status.reason`, the JSON of ``bnb-gc-fix status --json`` and the text
of ``bnb-gc-fix status`` -- is computed from those records here, so no two of them can disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

PATCHED, UNPATCHED, ARMED, NOT_NEEDED, OFF, SKIPPED = (
    "patched",
    "unpatched",
    "armed",
    "not needed",
    "off",
    "skipped",
)


@dataclass(frozen=True)
class LibraryStatus:
    """Everything about one library this package patches (see :mod:`bnb_gc_fix.targets`)."""

    name: str
    """The library: "bitsandbytes", "axolotl"."""
    module: str
    """The module whose functions are wrapped: "bitsandbytes.nn.parametrize"."""
    version: str | None
    """Its ``__version__``, or None while it is not imported."""
    state: str
    """One word, from what its module shows right now: "patched" (our wrappers are its functions
    now), "unpatched" (it was patched, then reloaded or imported again: its own functions are back),
    "armed" (patched the moment its module is imported), "not needed" (its code is right, or has
    nothing to patch), "off" (switched off by ``BNB_GC_FIX`` or ``deactivate()``), "skipped" (its
    code did not look as expected, or patching failed: nothing patched, one warning)."""
    affected: bool | None
    """Its code registers the leaking plain pair (None: not known, its module is not imported)."""
    probe: str | None
    """What the probe of its code saw, in a few words (None: not probed)."""
    reason: str
    """A human sentence: why it is, or is not, patched."""

    @property
    def patched(self) -> bool:
        """Our wrappers are its module's functions right now."""
        return self.state == PATCHED

    def as_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "patched": self.patched}


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process: the libraries, and torch's cache."""

    libraries: tuple[LibraryStatus, ...]
    """One record per library: bitsandbytes always (first), every other one that is imported or
    was decided on."""
    torch: str | None
    """``torch.__version__``, or None if torch is not imported."""
    counter: int | None
    """torch's parametrization-cache counter right now (above 0 after a step is the leak); None
    while torch's parametrize module is not imported (status() never imports it)."""
    cache_bytes: int | None
    """Bytes of tensors held by torch's parametrization cache right now; None like ``counter``."""
    mode: str
    """The ``BNB_GC_FIX`` mode: auto, on, off or force."""
    switch: str | None
    """The raw ``BNB_GC_FIX`` value, or None when unset."""
    via: str | None
    """How the fix was turned on: "start-up hook" or "runner" when that hook's finder fired in this
    process (it saw bitsandbytes about to run: it turned the fix on, or would have had the package not
    been imported first), "import" otherwise (also when another import hook in front of it answered
    for bitsandbytes), "activate()" after a deactivate(); None while nothing is patched or armed."""
    startup_hook: str
    """The ``.pth`` start-up hook or the runner in this process: "installed", "switched off" (it
    ran, and ``BNB_GC_FIX`` switched it off) or "not installed"."""
    cell_end_release: bool
    """In IPython/Jupyter: a cell that ends with an exception and leaves the cache switched on gets
    it released (``bnb_gc_fix.notebook``); installed with activation, on every bitsandbytes."""
    gil: bool = True
    """False on a free-threaded Python running without the GIL: the fix then gates with a lock, a
    path never tested on such a build (:attr:`reason` says so)."""
    import_errors: Mapping[str, str] = field(default_factory=dict)
    """Imports that failed in this process when ``bnb-gc-fix status`` or ``check`` tried them: module
    name -> what went wrong (installed but broken is never reported as missing)."""

    @property
    def bitsandbytes(self) -> LibraryStatus:
        """bitsandbytes' record."""
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
        """One word to act on, for the process: see :attr:`LibraryStatus.state`."""
        return self.deciding.state

    @property
    def active(self) -> bool:
        """The fix is at work in this process: some library is patched right now."""
        return self.state == PATCHED

    @property
    def reason(self) -> str:
        """Why :attr:`state` is what it is: the deciding library's sentence."""
        if self.gil:
            return self.deciding.reason
        return f"{self.deciding.reason}. {UNTESTED_FREE_THREADING}"

    def as_dict(self) -> dict[str, Any]:
        """Everything, as ``bnb-gc-fix status --json`` prints it (JSON-ready)."""
        facts: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        facts.update(
            libraries=[library.as_dict() for library in self.libraries],
            import_errors=dict(self.import_errors),
            state=self.state,
            active=self.active,
            reason=self.reason,
        )
        return facts

    def lines(self) -> list[str]:
        """The text of ``bnb-gc-fix status`` (and of ``print(status())``), a fact a line."""
        state = self.state
        if self.via and state in (PATCHED, ARMED):
            state += f", turned on by {_VIA.get(self.via, self.via)}"
        lines = [f"state:            {state}"]
        if len(self.libraries) > 1:
            lines[0] += f" (from {self.deciding.name})"
        if not self.gil:
            lines.append(f"  {UNTESTED_FREE_THREADING}")
        lines += [
            f"cache counter:    {_number(self.counter)}",
            f"cache bytes:      {_number(self.cache_bytes)}",
            f"BNB_GC_FIX:       {'unset' if self.switch is None else repr(self.switch)} (mode {self.mode})",
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
            lines.append(f"  affected:       {affected}")
            lines.append(f"  why:            {library.reason}")
        listed = {library.name for library in self.libraries} | {"torch"}  # named in their own lines
        for name, problem in self.import_errors.items():
            if name.split(".")[0] not in listed:
                lines.append(f"{name.split('.')[0]}: {problem}")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


UNTESTED_FREE_THREADING = (
    "Caution: this Python runs without the GIL (a free-threaded build); the fix then gates with "
    "a lock (_LockedGate), a path never tested on such a build"
)

_VIA = {"start-up hook": "the start-up hook", "runner": "bnb-gc-fix run", "import": "import bnb_gc_fix"}


_NO_RELEASE = "not installed (IPython/Jupyter only)"


def _number(value: int | None) -> str:
    return "- (torch's parametrization module is not imported)" if value is None else str(value)


def _missing(name: str, errors: Mapping[str, str]) -> str:
    """What a version-less library is: not installed, failing to import (see why), or not imported."""
    problem = next((errors[key] for key in errors if key.split(".")[0] == name), None)
    if problem is None:
        return "(not imported)"
    return "(not installed)" if problem.endswith(" is not installed") else "(fails to import: see why)"
