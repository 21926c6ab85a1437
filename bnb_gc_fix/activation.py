"""Turning the fix on and off, and where each library stands.

``activate()`` reads ``BNB_GC_FIX`` once and keeps what it read until the next ``activate()``. It
patches each library of ``_bnb_gc_fix.LIBRARIES`` now if its module is imported, else once its import
has completed: a watcher of the start-up hook (``_bnb_gc_fix/startup.py``) calls :func:`on_imported`.
Each library has one :class:`Library` record: its :class:`State`, the sentence behind it and the
verdict that produced it. :meth:`Library.now` is the one place that says where a library stands right
now; ``status()`` only reports it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import weakref
from types import ModuleType

import _bnb_gc_fix as words
from _bnb_gc_fix import BITSANDBYTES, LIBRARIES, Facts, startup
from bnb_gc_fix import decide, installed, notebook
from bnb_gc_fix.errors import PatchSkippedWarning, SwitchValueWarning, logger, warn


class State(enum.Enum):
    """Where one library stands; the value is the word ``status()`` reports (``_bnb_gc_fix`` says
    what each means). Listed worst first: where several libraries are imported, ``status()`` reports
    the worst, so a library left unprotected is never hidden by another one patched."""

    UNPATCHED = words.UNPATCHED
    SKIPPED = words.SKIPPED
    OFF = words.OFF
    PATCHED = words.PATCHED
    ARMED = words.ARMED
    NOT_NEEDED = words.NOT_NEEDED
    NOT_INSTALLED = words.NOT_INSTALLED


class Library:
    """One library the fix patches (``_bnb_gc_fix.LIBRARIES``), in this process: its state, why, and the
    verdict on its module."""

    def __init__(self, facts: Facts) -> None:
        self.facts = facts
        self.state = State.OFF  # until the first activation, which sets every library's state
        self.reason = "the fix has not been turned on in this process"
        self._verdict: tuple[weakref.ref[ModuleType], decide.Verdict] | None = None
        self.warned = False

    def module(self) -> ModuleType | None:
        return sys.modules.get(self.facts.module)

    def applied(self) -> bool:
        """Patched, and our wrappers are its module's functions right now (not reloaded since)."""
        module = self.module()
        if self.state is not State.PATCHED or module is None:
            return False
        from bnb_gc_fix import patch  # imports torch: only once something was patched

        return patch.is_applied(module, self.facts)

    def set(self, state: State, reason: str) -> None:
        self.state = state
        self.reason = reason

    def judge(self, module: ModuleType, mode: str) -> decide.Verdict:
        """Decide on ``module`` (probing its code) and record the verdict."""
        verdict = decide.judge(module, force=words.forces(mode), library=self.facts)
        self._verdict = (weakref.ref(module), verdict)
        return verdict

    @property
    def decided(self) -> bool:
        return self._verdict is not None

    def verdict(self) -> decide.Verdict | None:
        """The verdict recorded on the module imported right now; None if it was never judged (or was
        imported again since). Never probes."""
        if self._verdict is None:
            return None
        module_ref, verdict = self._verdict
        if module_ref() is not self.module():
            return None
        return verdict

    def now(self) -> tuple[State, str]:
        """The state and its sentence as this process shows them right now: the recorded state,
        unless what it promised no longer holds (the patch was undone since; what armed bitsandbytes
        waits for is not installed, fails to import, or will never come)."""
        if self.state is State.PATCHED and not self.applied():
            return State.UNPATCHED, _UNPATCHED.format(module=self.facts.module)
        if self.state is State.ARMED and self.facts is BITSANDBYTES:
            return _armed_bitsandbytes(self.reason)
        return self.state, self.reason


_UNPATCHED = (
    "the functions of {module} are no longer the fix's since it was patched (the module was reloaded or "
    "imported again, or something replaced them), so nothing is patched now; bnb_gc_fix.activate() "
    "patches it again"
)


def _armed_bitsandbytes(reason: str) -> tuple[State, str]:
    """Armed bitsandbytes, as it stands now: waiting, or never coming (too old, not installed, or
    failing to import). Reads ``sys.modules``, the import failures recorded by ``bnb-gc-fix`` commands,
    and ``sys.path``; imports nothing."""
    version = decide.library_version(BITSANDBYTES)
    if version is not None and decide.before_parametrize(version):  # it will never import parametrize
        return State.NOT_NEEDED, f"{decide.no_parametrize(version)}; nothing to patch"
    for name in ("torch", "bitsandbytes"):
        if installed.absent(name):
            return State.NOT_INSTALLED, _NOT_INSTALLED.format(name=name)
    failed = installed.failures()
    for name in ("torch", "bitsandbytes", BITSANDBYTES.module):
        if name in failed and name not in sys.modules:
            return State.ARMED, f"{failed[name]}; nothing to patch"
    return State.ARMED, reason


_NOT_INSTALLED = (
    "{name} is not installed, so there is nothing to patch now; the fix checks and patches bitsandbytes "
    "if it is installed and imported later in this process"
)


class _Process:
    """What activation knows in this process: the libraries, the switch as last read, how it was
    turned on."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.libraries = {facts.module: Library(facts) for facts in LIBRARIES}
        self.switch: str | None = None  # BNB_GC_FIX as the last activation read it
        self.mode = words.AUTO
        self.via: str | None = None  # a words.VIA_* value: what turned the fix on
        self.warned_switch = False


process = _Process()


def _renew_lock() -> None:
    """A forked child never waits on a lock that one of its parent's other threads held."""
    process.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


def _warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line, and never raise: where warnings are errors (``-W error``), the message
    goes to the log instead, since activation runs inside the user's import."""
    try:
        warn(message, category)
    except Exception:
        logger.warning("%s", message)


def _skip(library: Library, reason: str) -> None:
    """Nothing patched for an unexpected reason: say why, with one warning per library."""
    library.set(State.SKIPPED, reason)
    if not library.warned:
        library.warned = True
        _warn(f"bnb-gc-fix is not active: {reason}.", PatchSkippedWarning)


# --- patching one library ----------------------------------------------------------------------------
def _apply(library: Library, module: ModuleType, late: bool = False) -> None:
    """Decide on an imported library module and patch it if needed (under the lock). ``late``: it was
    imported before the fix was activated, so modules registered by it before now keep the plain pair."""
    from bnb_gc_fix import patch

    verdict = library.judge(module, process.mode)
    if verdict.unexpected:
        _skip(library, verdict.decision)
        return
    if not verdict.should_patch:
        library.set(State.NOT_NEEDED, verdict.decision)
        asked_for_it = process.mode == words.ON  # the user switched it on: say why nothing happened
        level = logging.INFO if asked_for_it else logging.DEBUG
        logger.log(level, "nothing needed patching: %s", verdict.reason)
        return
    patch.apply(module, library.facts)
    reason = verdict.decision
    if late:
        reason += (
            f". {library.facts.module} was already imported when the fix was activated: a model "
            "quantized before then keeps the plain pair; bnb_gc_fix.repair(model) replaces it"
        )
    library.set(State.PATCHED, reason)
    logger.info("%s", reason)


def _armed_reason(facts: Facts) -> str:
    when = ""
    if facts is BITSANDBYTES:
        when = " (bitsandbytes imports it when a model is quantized, not at `import bitsandbytes`)"
    return f"armed: {facts.module} is not imported yet{when}; the fix checks and patches it the moment it is"


def _arm(library: Library) -> None:
    """Patch the library's module now if it is imported, else once a watcher has seen its import end
    (the one under way through a watcher's loader, or the next)."""
    module = library.module()
    if module is not None and library.facts.module not in startup.executing:
        _apply(library, module, late=True)
        return
    library.set(State.ARMED, _armed_reason(library.facts))
    startup.watch_first()


def on_imported(name: str) -> None:
    """A watched module's code has run to its end (a watcher's loader says so): decide and patch it,
    as the last activation read the switch, if its library is armed. Never raises."""
    library = process.libraries.get(name)
    if library is None:
        return
    try:
        with process.lock:
            module = library.module()
            if library.state is State.ARMED and module is not None:  # not cancelled since
                _apply(library, module)
    except Exception as error:
        _skip(library, f"patching failed: {type(error).__name__}: {error}; nothing patched")


# --- activate and deactivate -------------------------------------------------------------------------
def _read_switch() -> None:
    """Read ``BNB_GC_FIX`` into ``process`` (it holds until the next activation); warn once about a
    value that is not known."""
    process.switch = os.environ.get(words.VARIABLE)
    process.mode, recognised = words.parse(process.switch)
    if recognised or process.warned_switch:
        return
    process.warned_switch = True
    _warn(
        f"{words.VARIABLE}={process.switch!r} is not a known value; accepted values are "
        f"{words.ACCEPTED}. Behaving as 'auto'.",
        SwitchValueWarning,
    )


def _switch_off() -> None:
    """``BNB_GC_FIX`` switches the fix off: every library not patched already is off (an earlier patch
    stays until ``deactivate()``)."""
    off = f"{words.VARIABLE}={process.switch!r} switches the fix off; nothing patched"
    for library in process.libraries.values():
        if not library.applied():
            library.set(State.OFF, f"disabled by the environment: {off}")


def _arm_every_library() -> None:
    """Patch every library not patched now (or reloaded since), now or when it is imported; one
    library's failure leaves the others armed."""
    for library in process.libraries.values():
        try:
            if not library.applied():
                _arm(library)
        except Exception as error:
            _skip(library, f"activation failed: {type(error).__name__}: {error}; nothing patched")


def activate(*, via: str = words.VIA_ACTIVATE) -> None:
    """Turn the fix on as ``BNB_GC_FIX`` says (read now): patch each known library now if imported,
    else when it is imported. Idempotent; never raises (a problem becomes a warning and a reason)."""
    try:
        with process.lock:
            _read_switch()
            if process.mode == words.OFF:
                _switch_off()
                return
            if process.via is None or not turned_on():  # what turned it on stays, while it stays on
                process.via = via
            notebook.install()
            _arm_every_library()
    except Exception as error:
        _skip(process.libraries[BITSANDBYTES.module], f"activation failed: {type(error).__name__}: {error}")


def deactivate() -> None:
    """Put every patched library's own functions back and cancel pending patches (gates already
    installed on modules keep working; ``repair()`` and ``reset()`` still work)."""
    with process.lock:
        for library in process.libraries.values():
            module = library.module()
            if module is not None:
                from bnb_gc_fix import patch  # imports torch, which the library's module has imported

                patch.remove(module, library.facts)
            library.set(State.OFF, "deactivated by deactivate()")
        notebook.remove()


def credit(via: str) -> None:
    """Say that ``via`` turned the fix on: a ``bnb-gc-fix`` command, whose own import of the package
    did, while that import is all that turned it on so far."""
    with process.lock:
        if process.via == words.VIA_IMPORT:
            process.via = via


def turned_on() -> bool:
    """bitsandbytes is armed, or some library is patched right now (what ``status().via`` is
    reported for; an armed copy in another library waits for a module that may never come)."""
    armed = process.libraries[BITSANDBYTES.module].state is State.ARMED
    return armed or any(library.applied() for library in process.libraries.values())


def forcing() -> bool:
    """Whether the last activation read ``BNB_GC_FIX=force``: the package's hooks replace pairs that
    are right already too (read at each use, so a later activation's reading holds at once)."""
    return words.forces(process.mode)
