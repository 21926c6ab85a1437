"""Turning the fix on and off: the environment switch, the lazy post-import hooks, and status.

``activate()`` patches each known library's module (:data:`bnb_gc_fix.targets.TARGETS`:
``bitsandbytes.nn.parametrize``, axolotl's ``moe_quant``) now if it is imported, or when its
import completes (a wrapt post-import hook; for a module being imported right now, the start-up
hook's loader calls back once its code has run). Where the installed code is already right
(upstream's fix, found by a probe of it), it steps aside and says why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from types import ModuleType

import _bnb_gc_fix_boot as boot
import _bnb_gc_fix_cache as cache
from bnb_gc_fix import decide, installed, notebook, report
from bnb_gc_fix.errors import PatchSkippedWarning, SwitchValueWarning
from bnb_gc_fix.report import LibraryStatus, Status
from bnb_gc_fix.targets import BITSANDBYTES, TARGETS, Target

logger = logging.getLogger("bnb_gc_fix")


class _Library:
    """The state of one target library in this process."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.patched = False
        self.pending = False
        self.hook_registered = False
        self.reason = "not activated"
        self.verdict: decide.Verdict | None = None
        self.warned_skip = False
        self.switched_off = False
        """Switched off by BNB_GC_FIX or deactivate()."""
        self.failed = False
        """Activation or patching raised (nothing patched)."""
        self.seen: decide.Verdict | None = None
        """A verdict made only to report (the fix switched off): what the probe sees, nothing patched."""
        self.seen_module: int | None = None
        """``id()`` of the module :attr:`seen` was made for."""

    def module(self) -> ModuleType | None:
        """The target module as imported right now (None if not imported)."""
        return sys.modules.get(self.target.module)

    def applied(self) -> bool:
        """Our wrappers are on the target module right now: the one test of "patched"."""
        module = self.module()
        if not self.patched or module is None:
            return False  # and nothing imported: status() never imports torch
        from bnb_gc_fix import patch

        return patch.is_applied(module, self.target)

    def lost(self) -> bool:
        """It was patched, and the module was reloaded or imported again since: its own functions are back."""
        return self.patched and not self.applied()


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.libraries = {target.module: _Library(target) for target in TARGETS}
        self.via: str | None = None
        self.warned_switch = False

    @property
    def bitsandbytes(self) -> _Library:
        return self.libraries[BITSANDBYTES.module]

    def on(self) -> bool:
        """Something is patched, or bitsandbytes waits to be (what ``via`` is reported for)."""
        return self.bitsandbytes.pending or any(lib.applied() for lib in self.libraries.values())


_state = _State()


def _renew_lock() -> None:
    _state.lock = threading.RLock()  # a forked child never waits on a lock a parent thread held


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(boot.__file__))


def _is_our_file(filename: str) -> bool:
    """Frames of this package, of the start-up hook, and of wrapt's post-import machinery."""
    wrapt_dir = os.sep + "wrapt" + os.sep
    return filename.startswith(_OURS) or wrapt_dir in filename


def _warn(message: str, category: type[Warning]) -> None:
    """Warn at the user's line: the first frame outside this package (import, activate(), hook).

    ``warnings`` itself skips importlib's frames without counting them, so they are skipped
    here without counting too.
    """
    level = 1
    frame = sys._getframe(0).f_back
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            level += 1
            if not _is_our_file(os.path.abspath(filename) if not filename.startswith("<") else filename):
                break
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level)


def _read_switch() -> str:
    raw = os.environ.get(boot.VARIABLE)
    mode, recognised = boot.parse(raw)
    if not recognised and not _state.warned_switch:
        _state.warned_switch = True
        _warn(
            f"{boot.VARIABLE}={raw!r} is not a known value; accepted values are {boot.ACCEPTED}. "
            "Behaving as 'auto'.",
            SwitchValueWarning,
        )
    return mode


def _skip(library: _Library, reason: str) -> None:
    """Nothing patched for an unexpected reason: say why, with one warning per library."""
    library.patched = False
    library.reason = reason
    if not library.warned_skip:
        library.warned_skip = True
        _warn(f"bnb-gc-fix is not active: {reason}.", PatchSkippedWarning)


def _apply(library: _Library, module: ModuleType, mode: str, late: bool = False) -> None:
    """Decide on an imported target module and patch it if needed (under the lock).

    ``late``: the module was imported before the fix was activated, so modules registered by it
    before now keep the plain pair.
    """
    from bnb_gc_fix import patch

    library.pending = False
    library.failed = False
    verdict = decide.judge(module, force=boot.forces(mode), target=library.target)
    library.verdict = verdict
    if verdict.unexpected:
        _skip(library, verdict.decision)
        return
    if not verdict.patch:
        library.patched = False
        library.reason = verdict.decision
        log = logger.info if mode == boot.ON else logger.debug
        log("nothing needed patching: %s", verdict.reason)
        return
    patch.apply(module, library.target, replace_always_called=boot.forces(mode))
    library.patched = True
    library.reason = verdict.decision
    if late:
        library.reason += (
            f". {library.target.module} was already imported when the fix was activated: a model "
            "quantized before then keeps the plain pair; bnb_gc_fix.repair(model) replaces it"
        )
    logger.info("%s", library.reason)


def _initializing(module: ModuleType) -> bool:
    """Whether ``module``'s code is still running (the import system's own flag, read only)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _arm(library: _Library, mode: str) -> None:
    """Patch the library's module now if it is imported, else when its import completes."""
    name = library.target.module
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        _apply(library, module, mode, late=True)
        return
    library.pending = True
    library.reason = (
        _ARMED_REASON
        if library.target is BITSANDBYTES
        else f"armed: {name} is not imported yet; the fix checks and patches it the moment it is"
    )
    if module is not None:
        # Half-initialised (the start-up hook fired on an import of bitsandbytes inside it): its
        # functions are not all defined yet. Decide once its code has run.
        if boot.when_complete(name, lambda: _on_complete(library)):
            logger.debug("%s is being imported; deciding once its code has run", name)
        elif not _initializing(module):
            _apply(library, module, mode)  # it completed meanwhile
        else:
            library.pending = False
            _skip(
                library,
                f"{name} was being imported when the fix was activated and that import cannot be "
                "watched; nothing patched (call bnb_gc_fix.activate() once it is imported)",
            )
        return
    if not library.hook_registered:
        import wrapt

        library.hook_registered = True
        wrapt.register_post_import_hook(_on_import, name)


def _on_import(module: ModuleType) -> None:
    """wrapt post-import hook, called once the module's code has run: must never raise."""
    library = _state.libraries.get(getattr(module, "__name__", ""))
    if library is not None:
        _on_complete(library)


def _on_complete(library: _Library) -> None:
    """A target module's code has run (or raised): decide and patch. Never raises."""
    try:
        with _state.lock:
            if not library.pending:  # deactivate() cancelled it
                return
            mode = boot.mode()
            if mode == boot.OFF:  # switched off since activation: the kill switch still holds
                library.pending = False
                library.switched_off = True
                library.reason = _disabled_reason()
                return
            module = sys.modules.get(library.target.module)
            if module is None:  # its import failed: wait for the next one
                _arm(library, mode)
            else:
                _apply(library, module, mode)
    except Exception as error:
        library.pending = False
        library.failed = True
        _skip(library, f"patching failed: {type(error).__name__}: {error}; nothing patched")


def activate(*, via: str = "activate()") -> Status:
    """Turn the fix on: patch each known library now if imported, else when it is imported.

    Idempotent. With ``BNB_GC_FIX`` set to 0/off/false/no nothing is patched and the status
    says so. Never raises: a problem becomes a warning and ``status().reason``.
    """
    try:
        with _state.lock:
            mode = _read_switch()
            if mode == boot.OFF:
                for library in _state.libraries.values():
                    if not library.applied():  # an earlier patch stays until deactivate()
                        library.patched = False
                        library.pending = False
                        library.switched_off = True
                        library.reason = _disabled_reason()
                return status()
            if _state.via is None or not _state.on():
                _state.via = via
            notebook.install()
            for library in _state.libraries.values():
                library.switched_off = False
                if library.patched and library.applied():
                    continue
                library.patched = False  # reloaded or imported again since: patch it again
                try:
                    _arm(library, mode)
                except Exception as error:  # one library's failure leaves the others armed
                    library.pending = False
                    library.failed = True
                    _skip(library, f"activation failed: {type(error).__name__}: {error}; nothing patched")
    except Exception as error:
        _state.bitsandbytes.failed = True
        _state.bitsandbytes.reason = f"activation failed: {type(error).__name__}: {error}; nothing patched"
        _warn(f"bnb-gc-fix is not active: {_state.bitsandbytes.reason}.", PatchSkippedWarning)
    return status()


def deactivate() -> None:
    """Put every patched library's own functions back and cancel pending patches.

    Gates already installed on modules keep working; ``repair()`` and ``reset()`` still work.
    """
    from bnb_gc_fix import patch

    with _state.lock:
        for library in _state.libraries.values():
            module = sys.modules.get(library.target.module)
            if module is not None:
                patch.remove(module, library.target)
            library.patched = False
            library.pending = False
            library.switched_off = True
            library.reason = "deactivated by deactivate()"
        notebook.remove()


def _env_value() -> str | None:
    return os.environ.get(boot.VARIABLE)


def _disabled_reason() -> str:
    switch = f"{boot.VARIABLE}={_env_value()!r}"
    return f"disabled by the environment: {switch} switches the fix off; nothing patched"


_ARMED_REASON = (
    f"armed: {decide.PARAMETRIZE} is not imported yet (bitsandbytes imports it when a model is "
    "quantized, not at `import bitsandbytes`); the fix checks and patches it the moment it is"
)


def _lost_reason(library: _Library) -> str:
    return (
        f"{library.target.module} was reloaded or imported again after it was patched, so its own "
        "functions are back and nothing is patched now; bnb_gc_fix.activate() patches it again"
    )


def _library_state(library: _Library, version: str | None) -> str:
    """One word for one library, from what its module shows right now."""
    if library.applied():
        return report.PATCHED
    if library.lost():
        return report.UNPATCHED
    if library.pending:
        if version is not None and decide.before_parametrize(version):
            return report.NOT_NEEDED
        return report.ARMED
    if library.switched_off:
        return report.OFF
    if library.failed or library.verdict is None or library.verdict.unexpected:
        return report.SKIPPED
    return report.NOT_NEEDED


def _verdict(library: _Library) -> decide.Verdict | None:
    """The decision on the library's module; made only to report where the fix did not decide (off).

    Reporting runs the same probe as the decision (the library's own function on a throwaway
    module) and patches nothing.
    """
    if library.verdict is not None:
        return library.verdict
    module = library.module()
    if module is None or _initializing(module):
        return None
    if library.seen is None or library.seen_module != id(module):
        try:
            library.seen = decide.judge(module, force=boot.forces(boot.mode()), target=library.target)
        except Exception:  # status() never raises
            return None
        library.seen_module = id(module)
    return library.seen


def _library_reason(library: _Library, version: str | None) -> str:
    if library.lost():
        return _lost_reason(library)
    if library.pending and library.target is BITSANDBYTES:
        return _pending_reason(version) or library.reason
    return library.reason


def _cache_now() -> tuple[int | None, int | None]:
    """torch's counter and the bytes its cache holds, without importing torch (None, None)."""
    if cache.parametrize() is None:
        return None, None
    try:
        return cache.counter(), cache.cached_bytes()
    except Exception:  # status() never raises
        return None, None


def _library_status(library: _Library) -> LibraryStatus:
    """One library's record, from what its module shows right now."""
    verdict = _verdict(library)
    version = library.target.version()
    return LibraryStatus(
        name=library.target.name,
        module=library.target.module,
        version=version,
        state=_library_state(library, version),
        affected=None if verdict is None else verdict.affected,
        probe=None if verdict is None else verdict.probe,
        reason=_library_reason(library, version),
    )


def _via() -> str | None:
    """How the fix was turned on. An import is credited to the start-up hook or the runner only if
    its finder fired (it saw bitsandbytes about to run, so it turned the fix on or would have):
    another import hook in front of it can hide bitsandbytes' import from it."""
    if not _state.on():
        return None
    return boot.trigger if _state.via == "import" and boot.trigger else _state.via


def _startup_hook() -> str:
    if boot.installed_watcher() is not None or boot.trigger is not None:
        return "installed"
    return "switched off" if boot.started_by is not None else "not installed"


def status() -> Status:
    """Where the fix stands in this process right now (never imports anything, never raises)."""
    counter, cache_bytes = _cache_now()
    return Status(
        libraries=tuple(
            _library_status(library)
            for library in _state.libraries.values()
            if library.target is BITSANDBYTES or library.verdict is not None or library.target.imported()
        ),
        torch=decide.torch_version(),
        counter=counter,
        cache_bytes=cache_bytes,
        mode=boot.mode(),
        switch=_env_value(),
        via=_via(),
        startup_hook=_startup_hook(),
        cell_end_release=notebook.installed(),
        gil=gil_enabled(),
        import_errors=installed.failures(),
    )


def gil_enabled() -> bool:
    """False on a free-threaded build running without the GIL (``sys._is_gil_enabled()``)."""
    return bool(getattr(sys, "_is_gil_enabled", lambda: True)())


def _pending_reason(bnb: str | None) -> str | None:
    """A truer sentence than "waiting" when what the patch waits for can never come, or failed."""
    if bnb is not None and decide.before_parametrize(bnb):
        return f"{decide.no_parametrize(bnb)}; nothing to patch"
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


def activate_on_import() -> None:
    """What ``import bnb_gc_fix`` does (status() credits the start-up hook or runner if it fired)."""
    activate(via="import")
