"""Turning the fix on in this process, and what it decided for each library.

``activate()`` reads ``BNB_GC_FIX``. It decides for each library's module now if that module is imported,
else when it is: the start-up hook's watcher (``_bnb_gc_fix.py``) calls :func:`imported` once the module's
code has run. A decision follows what the library's code was read to do (``bnb_gc_fix.reading``). There is
no turning the fix off in a running process: ``BNB_GC_FIX=0`` from the process's start is the off switch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from types import ModuleType
from typing import TYPE_CHECKING

import _bnb_gc_fix as startup
from bnb_gc_fix import census, lock
from bnb_gc_fix.libraries import LIBRARIES, Library
from bnb_gc_fix.lines import message
from bnb_gc_fix.releases import MIN_TORCH, release, version_of
from bnb_gc_fix.warning import PatchSkippedWarning, SwitchValueWarning, logger, warn_quietly

if TYPE_CHECKING:  # reading imports torch: imported where a library's module is, so torch is too
    from bnb_gc_fix.reading import Reading

IMPORT = "import bnb_gc_fix"
STARTUP_HOOK = "the start-up hook"
ACTIVATE = "activate()"


class Outcome(Enum):
    """What the fix did in a library's module, as decided."""

    FIXED = "the fix is in its hooks"
    NOT_NEEDED = "its hooks do not leak this way (or never switch the cache)"
    UNREAD = "what its hooks do could not be read; nothing changed"
    CANNOT_FIX = "its hooks leak (or force asked), but the fix cannot take their place safely"
    PENDING = "read on the first module it quantizes"


@dataclass
class Decision:
    """What the fix decided for one library's module."""

    module: ModuleType | None = None  # the module object decided for (None: not yet)
    spec: object = None  # its __spec__ then: importing it again, or reloading it, gives it another
    outcome: Outcome | None = None
    reading: Reading | None = None  # what its register function was read to register
    why_not: str | None = (
        None  # for CANNOT_FIX (and force on an unreadable one): the reason the user must hear
    )
    warned: bool = False


@dataclass
class Fix:
    """The fix in this process, as the activations so far left it."""

    switch: str | None = None  # BNB_GC_FIX as the activation that turned the fix on (or the last) read it
    mode: str = startup.AUTO
    turned_on_by: str | None = None  # None while the fix is off
    decisions: dict[str, Decision] = field(
        default_factory=lambda: {library.name: Decision() for library in LIBRARIES}
    )
    warned_switch: bool = False


fix = Fix()


def _warn_once(library: Library, decision: Decision) -> None:
    if decision.warned or decision.why_not is None:
        return
    decision.warned = True
    said = message(f"bnb-gc-fix is not active for {library.name}:", f"{decision.why_not}.")
    warn_quietly(said, PatchSkippedWarning)


def _torch_too_old() -> str | None:
    torch = release(version_of("torch"))
    if torch is None or torch >= MIN_TORCH:
        return None
    return f"torch {torch} cannot call a forward hook when the forward raises (needs torch >= {MIN_TORCH})"


def _why_it_cannot_go_in(what: Reading) -> str | None:
    """Why the fix cannot take the place of the pair read (None: it can)."""
    from bnb_gc_fix import reading

    if what.kind == reading.Kind.UNREADABLE:
        return f"{what.said}, so bnb-gc-fix cannot tell what its hooks do"
    if what.kind == reading.Kind.NOTHING:
        return f"{what.said}: there is nothing to put the fix into"
    if not what.replaceable:
        return f"{what.said}, and they are not plain Python functions that only switch the cache on and off"
    return _torch_too_old()


def _settle(library: Library, module: ModuleType, what: Reading) -> None:
    """Decide from what the library's register function was read to register."""
    from bnb_gc_fix import patch, reading

    decision = fix.decisions[library.name]
    decision.reading = what
    decision.why_not = None
    needed = what.kind == reading.Kind.LEAKS or fix.mode == startup.FORCE
    if not needed:
        decision.outcome = Outcome.NOT_NEEDED if what.kind != reading.Kind.UNREADABLE else Outcome.UNREAD
        patch.unwrap_register(module, library)  # nothing of the fix stays in a library that needs none
        return
    decision.why_not = _why_it_cannot_go_in(what)
    if decision.why_not is not None:
        decision.outcome = Outcome.CANNOT_FIX
        patch.unwrap_register(module, library)
        _warn_once(library, decision)
        return
    assert what.pair is not None
    patch.apply(what.pair, library)
    patch.wrap_register(module, library, decide=None)
    decision.outcome = Outcome.FIXED
    version = version_of(library.name)
    logger.info("bnb-gc-fix put its fix into %s %s (%s)", library.name, version, library.module_name)


def decided_for(library: Library, module: object) -> bool:
    """Whether the decision for the library is for ``module`` as its code last ran (the import system
    gives a module imported again, or reloaded, a spec of its own)."""
    decision = fix.decisions[library.name]
    return decision.module is module and decision.spec is getattr(module, "__spec__", None)


def _decide(library: Library, module: ModuleType) -> None:
    """Decide for the library's module from what its register function's code says it registers, or,
    where the code does not say it plainly, at the first module the library quantizes, from what it
    registered there. For a module decided for already, again from what was read (the mode may have
    changed; the fix, once in, stays in)."""
    from bnb_gc_fix import code_reading, patch, reading

    decision = fix.decisions[library.name]
    if decided_for(library, module) and decision.outcome in (Outcome.FIXED, Outcome.PENDING):
        return
    if decided_for(library, module) and decision.reading is not None:
        _settle(library, module, decision.reading)
        return
    decision.module = module
    decision.spec = getattr(module, "__spec__", None)
    register = patch.own_register(module, library)
    if not callable(register):
        _settle(library, module, reading.without_a_register_function(library))
        return
    what = code_reading.read(library, register)
    if what is None:
        _wait_for_a_real_module(library, module)
    else:
        _settle(library, module, what)


def _wait_for_a_real_module(library: Library, module: ModuleType) -> None:
    """Wrap the library's register function: the first module the library quantizes through it decides.
    Nothing of the library is called before."""
    from bnb_gc_fix import patch

    decision = fix.decisions[library.name]
    decision.outcome = Outcome.PENDING
    decision.reading = None

    def settle_later(real: Reading) -> None:  # inside the user's quantizing call: never raises
        try:
            with lock.held():
                _settle(library, module, real)
        except Exception as error:
            said = message(
                f"bnb-gc-fix could not decide for {library.name}:", f"{type(error).__name__}: {error}"
            )
            warn_quietly(said, PatchSkippedWarning)

    patch.wrap_register(module, library, decide=settle_later)


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
    if mode == startup.OFF and fix.turned_on_by is not None:
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
    imported before the fix turned on, or where the fix could not see it. Not so where the start-up hook
    imports the package because that module's code has just run."""
    return not decided_for(library, module) and not startup.importing_package


def activate(via: str = ACTIVATE) -> None:
    """Turn the fix on as ``BNB_GC_FIX`` says now: decide for each library's module now if it is imported,
    else the moment it is. Idempotent; never raises (a problem becomes a warning and a reason in status())."""
    try:
        with lock.held():
            fix.mode = _read_switch()
            if fix.mode == startup.OFF:
                return
            fix.turned_on_by = fix.turned_on_by or via
            startup.watch()
            for library in LIBRARIES:
                module = _imported_whole(library)
                if module is None:
                    continue
                if _may_have_quantized(library, module):
                    census.note_the_leaking(library.module_name)  # once: status() looks them up
                _decide(library, module)
    except Exception as error:  # never into the user's import
        said = message("bnb-gc-fix could not turn on:", f"{type(error).__name__}: {error}")
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
            if fix.turned_on_by is not None:
                _decide(library, module)
    except Exception as error:
        said = message(f"bnb-gc-fix could not put its fix into {name}:", f"{type(error).__name__}: {error}")
        warn_quietly(said, PatchSkippedWarning)
