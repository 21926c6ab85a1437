"""Turning the fix on and off in this process, and what it decided for each library.

``activate()`` reads ``BNB_GC_FIX`` and keeps what it read until the next ``activate()``. It puts the fix
into each library's module now if that module is imported, else when it is: the start-up hook's watcher
(``_bnb_gc_fix.py``) calls :func:`imported` once the module's code has run.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import ModuleType

import _bnb_gc_fix as startup
from _bnb_gc_fix import LIBRARIES, Library
from bnb_gc_fix import lock, notebook
from bnb_gc_fix.errors import PatchSkippedWarning, SwitchValueWarning, logger, warn_quietly
from bnb_gc_fix.releases import MIN_TORCH, affected, release, version_of

IMPORT = "import bnb_gc_fix"
STARTUP_HOOK = "the start-up hook"
ACTIVATE = "activate()"


@dataclass
class Decision:
    """What the last activation decided for one library."""

    decided: bool = False  # its module was imported while the fix was on, and looked at
    patched: bool = False  # the fix was put into its module (its release is affected, or BNB_GC_FIX=force)
    skipped: str | None = None  # why the fix could not be put in, for a reason the user must hear
    late: bool = False  # its module was imported before the fix was put into it
    warned: bool = False


@dataclass
class Process:
    """What activation knows in this process."""

    switch: str | None = None  # BNB_GC_FIX as the last activation read it
    mode: str = startup.AUTO
    turned_on_by: str | None = None  # None while the fix is off
    deactivated: bool = False
    decisions: dict[str, Decision] = field(
        default_factory=lambda: {lib.name: Decision() for lib in LIBRARIES}
    )
    warned_switch: bool = False


process = Process()


def _why_not(library: Library, module: ModuleType) -> str | None:
    """Why the fix must not go into the library's module (None: it may)."""
    from bnb_gc_fix import patch  # imports torch, which the library's module has imported

    torch = release(version_of("torch"))
    if torch is not None and torch < MIN_TORCH:
        return (
            f"torch {torch} cannot call a forward hook when the forward raises (needs torch >= {MIN_TORCH})"
        )
    version = version_of(library.name)
    if process.mode != startup.FORCE and affected(library, version) is None:
        return (
            f"{library.name}'s version {version!r} cannot be read; {startup.VARIABLE}=force puts the fix in"
        )
    return patch.unexpected(module, library)


def _decide(library: Library, module: ModuleType) -> None:
    """Put the fix into an imported library module where it is needed and can be."""
    from bnb_gc_fix import patch

    decision = process.decisions[library.name]
    decision.decided = True
    decision.skipped = _why_not(library, module)
    if decision.skipped is not None:
        if not decision.warned:
            decision.warned = True
            warn_quietly(
                f"bnb-gc-fix is not active for {library.name}: {decision.skipped}", PatchSkippedWarning
            )
        return
    needed = process.mode == startup.FORCE or affected(library, version_of(library.name))
    if needed:
        patch.apply(module, library)
        logger.info("the fix is in %s %s (%s)", library.name, version_of(library.name), library.module)
    decision.patched = bool(needed)


def _imported_whole(library: Library) -> ModuleType | None:
    """The library's module, if it is imported and its code has run to its end."""
    if library.module in startup.executing:
        return None
    return sys.modules.get(library.module)


def _read_switch() -> None:
    process.switch = os.environ.get(startup.VARIABLE)
    mode = startup.mode_of(process.switch)
    process.mode = startup.AUTO if mode is None else mode
    if mode is None and not process.warned_switch:
        process.warned_switch = True
        accepted = ", ".join(
            "/".join(s or "unset" for s in spellings) for spellings in startup.SPELLINGS.values()
        )
        message = (
            f"{startup.VARIABLE}={process.switch!r} is not a known value ({accepted}); behaving as 'auto'"
        )
        warn_quietly(message, SwitchValueWarning)


def activate(via: str = ACTIVATE) -> None:
    """Turn the fix on as ``BNB_GC_FIX`` says now: into each library's module now if it is imported, else
    the moment it is. Idempotent; never raises (a problem becomes a warning and a reason in status())."""
    try:
        with lock.held():
            _read_switch()
            if process.mode == startup.OFF:
                _turn_off(deactivated=False)
                return
            process.deactivated = False
            process.turned_on_by = process.turned_on_by or via
            notebook.install()
            startup.watch()
            for library in LIBRARIES:
                module = _imported_whole(library)
                decision = process.decisions[library.name]
                if module is not None:
                    decision.late = decision.late or not decision.decided  # imported before the fix was on
                    _decide(library, module)
    except Exception as error:  # never into the user's import
        warn_quietly(f"bnb-gc-fix could not turn on: {type(error).__name__}: {error}", PatchSkippedWarning)


def imported(name: str) -> None:
    """The watcher's word that the module ``name`` has been imported (or imported again): nothing was
    quantized with it yet. Never raises."""
    library = next((library for library in LIBRARIES if library.module == name), None)
    module = sys.modules.get(name)
    if library is None or module is None:
        return
    try:
        with lock.held():
            if process.turned_on_by is not None:
                process.decisions[library.name].late = False
                _decide(library, module)
    except Exception as error:
        warn_quietly(
            f"bnb-gc-fix could not patch {name}: {type(error).__name__}: {error}", PatchSkippedWarning
        )


def deactivate() -> None:
    """Put every library's own code back; modules the fix took over keep one pair of the library's hooks,
    registered as the library registers them. ``activate()`` turns the fix on again."""
    with lock.held():
        _turn_off(deactivated=True)


def _turn_off(deactivated: bool) -> None:
    for library in LIBRARIES:
        module = sys.modules.get(library.module)
        if module is not None and process.decisions[library.name].patched:
            from bnb_gc_fix import gate, patch  # torch is imported: the library's module imported it

            patch.remove(module, library)
            gate.let_every_module_go()
        process.decisions[library.name] = Decision(warned=process.decisions[library.name].warned)
    process.turned_on_by = None
    process.deactivated = deactivated
    notebook.remove()
