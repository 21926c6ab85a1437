"""Turning the fix on and off: ``activate()`` reads ``BNB_GC_FIX`` once, keeps it until the next
``activate()``, and patches each library of :data:`bnb_gc_fix.targets.TARGETS` now if its module is
imported, else once its import completes (:func:`_bnb_gc_fix_boot.when_imported`, the one import-watching
mechanism). Each library is in one :class:`State`, set here only, with the sentence and verdict behind it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import warnings
import weakref
from types import ModuleType

import _bnb_gc_fix_boot as boot
from bnb_gc_fix import decide, notebook
from bnb_gc_fix.errors import PatchSkippedWarning, SwitchValueWarning
from bnb_gc_fix.targets import BITSANDBYTES, TARGETS, Target

logger = logging.getLogger("bnb_gc_fix")


class State(enum.Enum):
    """Where one library stands; the value is the word ``status()`` reports."""

    PATCHED = "patched"  # our wrappers are its module's functions
    UNPATCHED = "unpatched"  # never set here: status' word for PATCHED once a reload undid it
    ARMED = "armed"  # patched the moment its module is imported
    NOT_NEEDED = "not needed"  # its code is right (upstream's fix), or it has nothing to patch
    OFF = "off"  # switched off by BNB_GC_FIX or deactivate()
    SKIPPED = "skipped"  # its code did not look as expected, or patching failed: one warning


class Library:
    """One target library in this process: its state, why, and the verdict on its module."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.state = State.SKIPPED  # until the first activation, which sets every library's state
        self.reason = "not activated"
        self._verdict: tuple[weakref.ref[ModuleType], decide.Verdict] | None = None
        self.warned = False

    def module(self) -> ModuleType | None:
        return sys.modules.get(self.target.module)

    def applied(self) -> bool:
        """Patched, and our wrappers are its module's functions right now (not reloaded since)."""
        module = self.module()
        if self.state is not State.PATCHED or module is None:
            return False
        from bnb_gc_fix import patch  # imports torch: only once something was patched

        return patch.is_applied(module, self.target)

    def set(self, state: State, reason: str) -> None:
        self.state, self.reason = state, reason

    @property
    def decided(self) -> bool:
        return self._verdict is not None

    def verdict(self, mode: str) -> decide.Verdict | None:
        """The verdict on the module imported right now: the decision's, else made now to report (the
        probe runs the library's own code on a throwaway module and patches nothing). Never raises."""
        module = self.module()
        if module is None or initializing(module):
            return None
        if self._verdict is None or self._verdict[0]() is not module:
            try:
                self.judge(module, mode)
            except Exception:
                return None
        return None if self._verdict is None else self._verdict[1]

    def judge(self, module: ModuleType, mode: str) -> decide.Verdict:
        verdict = decide.judge(module, force=boot.forces(mode), target=self.target)
        self._verdict = (weakref.ref(module), verdict)
        return verdict


class _Process:
    """What activation knows in this process: the libraries, the switch as last read, how it was turned on."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.libraries = {target.module: Library(target) for target in TARGETS}
        self.switch: str | None = None  # BNB_GC_FIX as the last activation read it (activate())
        self.mode = boot.AUTO
        self.via: str | None = None
        self.warned_switch = False


process = _Process()


if hasattr(os, "register_at_fork"):  # a forked child never waits on a lock a parent thread held
    os.register_at_fork(after_in_child=lambda: setattr(process, "lock", threading.RLock()))


_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(boot.__file__))


def _warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line: the first frame outside this package and the start-up hook (importlib's
    frames are skipped without counting, as ``warnings`` does)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            level += 1
            path = filename if filename.startswith("<") else os.path.abspath(filename)
            if not path.startswith(_OURS):
                break
        frame = frame.f_back  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)


def _skip(library: Library, reason: str) -> None:
    """Nothing patched for an unexpected reason: say why, with one warning per library."""
    library.set(State.SKIPPED, reason)
    if not library.warned:
        library.warned = True
        _warn(f"bnb-gc-fix is not active: {reason}.", PatchSkippedWarning)


def initializing(module: ModuleType) -> bool:
    """Whether ``module``'s code is still running (the import system's own flag, read only)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _apply(library: Library, module: ModuleType, late: bool = False) -> None:
    """Decide on an imported target module and patch it if needed (under the lock). ``late``: it was
    imported before the fix was activated, so modules registered by it before now keep the plain pair."""
    from bnb_gc_fix import patch

    verdict = library.judge(module, process.mode)
    if verdict.unexpected:
        _skip(library, verdict.decision)
    elif not verdict.patch:
        library.set(State.NOT_NEEDED, verdict.decision)
        (logger.info if process.mode == boot.ON else logger.debug)(
            "nothing needed patching: %s", verdict.reason
        )
    else:
        patch.apply(module, library.target, replace_always_called=boot.forces(process.mode))
        reason = verdict.decision
        if late:
            reason += (
                f". {library.target.module} was already imported when the fix was activated: a model "
                "quantized before then keeps the plain pair; bnb_gc_fix.repair(model) replaces it"
            )
        library.set(State.PATCHED, reason)
        logger.info("%s", reason)


def _arm(library: Library) -> None:
    """Patch the library's module now if it is imported, else once its import (under way, or next) ends."""
    name = library.target.module
    module = sys.modules.get(name)
    late = module is not None and not initializing(module)
    if not late:
        library.set(State.ARMED, ARMED_REASON if library.target is BITSANDBYTES else _armed(name))
        if boot.when_imported(name, _on_imported):
            if module is not None:
                logger.debug("%s is being imported; deciding once its code has run", name)
            return
        module = sys.modules.get(name)
        if module is None or initializing(module):  # being imported by a loader no watcher wraps
            _skip(
                library,
                f"{name} was being imported when the fix was activated and that import cannot be "
                "watched; nothing patched (call bnb_gc_fix.activate() once it is imported)",
            )
            return
    assert module is not None
    _apply(library, module, late=late)


def _on_imported(name: str) -> None:
    """A target module's code has run to its end: decide and patch, as the last activation read the
    switch. Never raises."""
    library = process.libraries[name]  # registered by _arm only, for a library's module
    try:
        with process.lock:
            if library.state is not State.ARMED:  # deactivate() or an activate() switched off cancelled it
                return
            module = library.module()
            if module is None:  # removed from sys.modules meanwhile: wait for the next import
                _arm(library)
            else:
                _apply(library, module)
    except Exception as error:
        _skip(library, f"patching failed: {type(error).__name__}: {error}; nothing patched")


def activate(*, via: str = "activate()") -> None:
    """Turn the fix on as ``BNB_GC_FIX`` says (read now): patch each known library now if imported,
    else when it is imported. Idempotent; never raises (a problem becomes a warning and a reason)."""
    try:
        with process.lock:
            process.switch = os.environ.get(boot.VARIABLE)  # read once: it holds until the next activate()
            process.mode, recognised = boot.parse(process.switch)
            if not recognised and not process.warned_switch:
                process.warned_switch = True
                _warn(
                    f"{boot.VARIABLE}={process.switch!r} is not a known value; accepted values are "
                    f"{boot.ACCEPTED}. Behaving as 'auto'.",
                    SwitchValueWarning,
                )
            if process.mode == boot.OFF:
                off = f"{boot.VARIABLE}={process.switch!r} switches the fix off; nothing patched"
                for library in process.libraries.values():
                    if not library.applied():  # an earlier patch stays until deactivate()
                        library.set(State.OFF, f"disabled by the environment: {off}")
                return
            if process.via is None or not on():
                process.via = via
            notebook.install()
            for library in process.libraries.values():
                try:  # not patched, or reloaded since: patch it (again)
                    if not library.applied():
                        _arm(library)
                except Exception as error:  # one library's failure leaves the others armed
                    _skip(library, f"activation failed: {type(error).__name__}: {error}; nothing patched")
    except Exception as error:
        _skip(process.libraries[BITSANDBYTES.module], f"activation failed: {type(error).__name__}: {error}")


def deactivate() -> None:
    """Put every patched library's own functions back and cancel pending patches (gates already
    installed on modules keep working; ``repair()`` and ``reset()`` still work)."""
    from bnb_gc_fix import patch

    with process.lock:
        for library in process.libraries.values():
            module = library.module()
            if module is not None:
                patch.remove(module, library.target)
            library.set(State.OFF, "deactivated by deactivate()")
        notebook.remove()


def on() -> bool:
    """Something is patched or armed (what ``status().via`` is reported for)."""
    armed = process.libraries[BITSANDBYTES.module].state is State.ARMED
    return armed or any(library.applied() for library in process.libraries.values())


def _armed(name: str) -> str:
    return f"armed: {name} is not imported yet; the fix checks and patches it the moment it is"


ARMED_REASON = (
    f"armed: {decide.PARAMETRIZE} is not imported yet (bitsandbytes imports it when a model is "
    "quantized, not at `import bitsandbytes`); the fix checks and patches it the moment it is"
)
