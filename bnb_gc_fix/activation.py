"""Turning the fix on in this process, and what it decided for each library.

``activate()`` reads ``BNB_GC_FIX``. It decides for each library's module now if that module is imported,
else when it is: the start-up hook's watcher (``_bnb_gc_fix.py``) calls :func:`imported` once the module's
code has run. A decision reads the library's code (``bnb_gc_fix.reading``), decides, and puts the fix in
(``bnb_gc_fix.patch``), in that order. There is no turning the fix off in a running process:
``BNB_GC_FIX=0`` from the process's start is the off switch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import _bnb_gc_fix as startup
from bnb_gc_fix import census, lock
from bnb_gc_fix.libraries import LIBRARIES, Library
from bnb_gc_fix.lines import message
from bnb_gc_fix.releases import MIN_TORCH, release, version_of
from bnb_gc_fix.verdict import Hooks
from bnb_gc_fix.warning import PatchSkippedWarning, SwitchValueWarning, warn_quietly

if TYPE_CHECKING:  # reading imports torch: imported where a library's module is, so torch is too
    from bnb_gc_fix.reading import Reading

IMPORT = "import bnb_gc_fix"
STARTUP_HOOK = "the start-up hook"
ACTIVATE = "activate()"


@dataclass
class Decision:
    """What the fix decided for one library's module."""

    module: ModuleType | None = None  # the module object decided for (None: not yet)
    spec: object = None  # its __spec__ then: importing it again, or reloading it, gives it another
    reading: Reading | None = None  # what its register function was read to register
    fixed: bool = False  # the fix is in its hooks
    why_not: str | None = None  # why the fix is not in hooks that need it (or that force asked for)
    warned: bool = False


@dataclass
class Fix:
    """The fix in this process, as the activations so far left it. Asking for the fix and the fix going
    into a library's hooks are two facts: ``asked_by`` holds the first, each decision the second."""

    switch: str | None = None  # BNB_GC_FIX as the last activation read it (a late off switch aside)
    mode: str = startup.AUTO
    asked_by: str | None = None  # who asked for the fix first (None: nobody, or BNB_GC_FIX switched it off)
    decisions: dict[str, Decision] = field(
        default_factory=lambda: {library.name: Decision() for library in LIBRARIES}
    )
    warned_switch: bool = False


fix = Fix()


def _torch_too_old() -> str | None:
    torch = release(version_of("torch"))
    if torch is None or torch >= MIN_TORCH:
        return None
    return f"torch {torch} cannot call a forward hook when the forward raises (needs torch >= {MIN_TORCH})"


def _failed(error: Exception) -> str:
    """An exception's words, with the remedy where a dependency fails to import (a wheel built for another
    Python, say): reinstall the package it came from."""
    said = f"{type(error).__name__}: {error}"
    broken = _package_raising(error) if isinstance(error, ImportError) else None
    return said if broken is None else f"{said}; reinstall {broken}"


def _package_raising(error: ImportError) -> str | None:
    """The top-level package whose code raised ``error`` (outside the import system and this package), or
    the one it names as missing."""
    names = []
    trace = error.__traceback__
    while trace is not None:
        names.append(str(trace.tb_frame.f_globals.get("__name__", "")))
        trace = trace.tb_next
    outside = [
        name for name in names if not name.startswith(("importlib", "_frozen_importlib", "bnb_gc_fix"))
    ]
    named = outside[-1] if outside else (error.name or "")
    return named.split(".")[0] or None


def _why_it_cannot_go_in(what: Reading) -> str | None:
    """Why the fix cannot take the place of the hooks read (None: it can)."""
    if what.hooks is Hooks.UNREADABLE:
        return f"bnb-gc-fix cannot read its hooks ({what.said}); `bnb-gc-fix check` shows whether they leak"
    if what.pair is None:
        return f"{what.said}: there is nothing to put the fix into"
    return _torch_too_old()


def _put_in(library: Library, module: ModuleType, decision: Decision) -> None:
    """Put the fix into the library's hooks where they need it (or force asks), or say why it cannot go
    in, with one warning."""
    assert decision.reading is not None
    if decision.reading.hooks is Hooks.DO_NOT_LEAK and fix.mode != startup.FORCE:
        return
    decision.why_not = _why_it_cannot_go_in(decision.reading)
    if decision.why_not is None and decision.reading.pair is not None:
        try:
            from bnb_gc_fix import patch  # imports wrapt

            patch.put_in(module, decision.reading.pair, library)
            decision.fixed = True
        except Exception as error:  # wrapt failing to import, say: the library runs as without the fix
            decision.why_not = _failed(error)
    if decision.why_not is not None and not decision.warned:
        decision.warned = True
        named = f"{library.name} {version_of(library.name)}"
        warn_quietly(message(f"bnb-gc-fix is not in {named}:", f"{decision.why_not}."), PatchSkippedWarning)


def decided_for(library: Library, module: object) -> bool:
    """Whether the decision for the library is for ``module`` as its code last ran (the import system
    gives a module imported again, or reloaded, a spec of its own)."""
    decision = fix.decisions[library.name]
    return decision.module is module and decision.spec is getattr(module, "__spec__", None)


def _decide(library: Library, module: ModuleType) -> None:
    """Read the library's code once for this module object, then put the fix in where the mode asks it
    (again for a module decided for: the mode may have changed; the fix, once in, stays in)."""
    from bnb_gc_fix import reading

    if not decided_for(library, module):
        what = reading.read(library, module)
        fix.decisions[library.name] = Decision(module, getattr(module, "__spec__", None), what)
    decision = fix.decisions[library.name]
    if not decision.fixed:
        _put_in(library, module, decision)


def _imported_whole(library: Library) -> ModuleType | None:
    """The library's module, if it is imported and its code has run to its end."""
    if library.module_name in startup.executing:
        return None
    return sys.modules.get(library.module_name)


def _read_switch() -> str:
    """BNB_GC_FIX now, as a mode (an unknown value warns once and reads as auto)."""
    switch = os.environ.get(startup.VARIABLE)
    mode = startup.mode_of(switch)
    if mode is None and not fix.warned_switch:
        fix.warned_switch = True
        accepted = ", ".join(
            "/".join(s or "unset" for s in spellings) for spellings in startup.SPELLINGS.values()
        )
        said = message(
            f"{startup.VARIABLE}={switch!r} is not a known value: behaving as 'auto'.",
            f"Known values: {accepted}.",
        )
        warn_quietly(said, SwitchValueWarning)
    if mode == startup.OFF and fix.asked_by is not None:
        said = message(
            f"{startup.VARIABLE}={switch!r} came too late: the fix stays on in this process.",
            f"A running process cannot switch it off; set {startup.VARIABLE}=0 before the process starts "
            "to run without it.",
        )
        warn_quietly(said, SwitchValueWarning)
        return fix.mode
    fix.switch = switch
    return startup.AUTO if mode is None else mode


def _may_have_quantized(library: Library, module: ModuleType) -> bool:
    """Whether modules quantized with the library's module may be alive that the fix never saw: it was
    imported before the fix was asked for, or where the fix could not see it. Not so where the start-up
    hook imports the package because that module's code has just run."""
    return not decided_for(library, module) and not startup.importing_package


def activate(via: str = ACTIVATE) -> None:
    """Ask for the fix as ``BNB_GC_FIX`` says now: decide for each library's module now if it is imported,
    else the moment it is. Idempotent; never raises (a problem becomes a warning and a reason in status())."""
    try:
        with lock.held():
            fix.mode = _read_switch()
            if fix.mode == startup.OFF:
                return
            fix.asked_by = fix.asked_by or via
            startup.watch()
            for library in LIBRARIES:
                module = _imported_whole(library)
                if module is None:
                    continue
                if _may_have_quantized(library, module):
                    census.note_quantized(library.module_name)  # once: status() looks them up
                _decide(library, module)
    except Exception as error:  # never into the user's import
        said = message("bnb-gc-fix could not turn on:", _failed(error))
        warn_quietly(said, PatchSkippedWarning)


def imported(name: str) -> None:
    """The watcher's word that the module ``name`` has been imported (or imported again): nothing was
    quantized with it yet. Never raises."""
    library = next((library for library in LIBRARIES if library.module_name == name), None)
    module = sys.modules.get(name)
    if library is None or module is None:
        return
    try:
        with lock.held():
            if fix.asked_by is not None:
                _decide(library, module)
    except Exception as error:
        said = message(f"bnb-gc-fix could not decide for {name}:", _failed(error))
        warn_quietly(said, PatchSkippedWarning)
