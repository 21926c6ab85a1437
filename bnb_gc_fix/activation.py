"""Turning the fix on and off: the environment switch, the lazy post-import hooks, and status.

``activate()`` patches each known library's module (:data:`bnb_gc_fix.targets.TARGETS`:
``bitsandbytes.nn.parametrize``, axolotl's ``moe_quant``) now if it is imported, or when its
import completes (a wrapt post-import hook; :mod:`bnb_gc_fix.inflight` for a module that is being
imported right now). Where the installed code is already right (upstream's fix, found by a probe
of it), it steps aside and says why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType

import _bnb_gc_fix_boot as boot
from bnb_gc_fix import decide, inflight, notebook
from bnb_gc_fix.errors import PatchSkippedWarning, SwitchValueWarning
from bnb_gc_fix.targets import BITSANDBYTES, TARGETS, Target

logger = logging.getLogger("bnb_gc_fix")


@dataclass(frozen=True)
class LibraryStatus:
    """Where the fix stands for one patched library (see :mod:`bnb_gc_fix.targets`)."""

    name: str
    """The library: "bitsandbytes", "axolotl"."""
    version: str | None
    """Its ``__version__``, or None if it is not imported."""
    affected: bool | None
    """Its code registers the leaking plain pair (None: not known yet)."""
    patched: bool
    """Its functions are wrapped by this package right now."""
    reason: str
    """A human sentence: why it is, or is not, patched."""


@dataclass(frozen=True)
class Status:
    """Where the fix stands in this process."""

    active: bool
    """bitsandbytes' functions are wrapped by this package right now."""
    reason: str
    """A human sentence: why the fix is, or is not, active."""
    bitsandbytes: str | None
    """``bitsandbytes.__version__``, or None if bitsandbytes is not imported."""
    torch: str | None
    """``torch.__version__``, or None if torch is not imported."""
    state: str = "off"
    """One word a user can act on: "patched" (the fix is on: bitsandbytes, or a look-alike library
    in :attr:`libraries`, is patched), "armed" (waiting for bitsandbytes' 4-bit code to be
    imported, then it decides and patches), "not needed" (this bitsandbytes cannot leak this way),
    "off" (switched off by BNB_GC_FIX or deactivate()), "skipped" (bitsandbytes or torch internals
    did not look as expected; nothing patched, one warning)."""
    counter: int | None = None
    """torch's parametrization-cache counter right now (above 0 after a step is the leak); None
    while torch's parametrize module is not imported (status() never imports it)."""
    cache_bytes: int | None = None
    """Bytes of tensors held by torch's parametrization cache right now; None like ``counter``."""
    pending: bool = False
    """Waiting for ``bitsandbytes.nn.parametrize`` to be imported, to decide and patch then."""
    affected: bool | None = None
    """The imported bitsandbytes registers the leaking plain pair (None: not known yet)."""
    probe: str | None = None
    """What the probe of bitsandbytes' code saw, in a few words."""
    mode: str = boot.AUTO
    """The ``BNB_GC_FIX`` mode: auto, on, off or force."""
    switch: str | None = None
    """The raw ``BNB_GC_FIX`` value, or None when unset."""
    via: str | None = None
    """How the fix was turned on: "start-up hook" or "runner" when that hook was installed in the
    process when the package was first imported (it would have turned the fix on anyway), "import"
    when nothing else was, "activate()" after a deactivate(); None while the fix is off (nothing
    patched, and bitsandbytes not waiting to be)."""
    libraries: tuple[LibraryStatus, ...] = ()
    """Every known library (bitsandbytes, axolotl, ...) that is imported or was decided on, with
    its version, whether it is affected, and whether it is patched or why not. The other fields
    describe bitsandbytes alone (and torch's cache, for ``counter`` and ``cache_bytes``)."""
    cell_end_release: bool = False
    """In IPython/Jupyter: a cell that ends with an exception and leaves the cache switched on gets
    it released (``bnb_gc_fix.notebook``); installed with activation, on every bitsandbytes."""


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


_OURS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(boot.__file__))


def _is_ours(filename: str) -> bool:
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
            if not _is_ours(os.path.abspath(filename) if not filename.startswith("<") else filename):
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
    verdict = decide.judge(module, force=mode == boot.FORCE, target=library.target)
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
    patch.apply(module, library.target, replace_always_called=verdict.affected is False)
    library.patched = True
    library.reason = verdict.decision
    if late:
        library.reason += (
            f". {library.target.module} was already imported when the fix was activated: a model "
            "quantized before then keeps the plain pair; bnb_gc_fix.repair(model) replaces it"
        )
    logger.info("%s", library.reason)


def _arm(library: _Library, mode: str) -> None:
    """Patch the library's module now if it is imported, else when its import completes."""
    name = library.target.module
    module = sys.modules.get(name)
    if module is not None and not inflight.initializing(module):
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
        if inflight.when_complete(module, lambda: _on_complete(library)):
            logger.debug("%s is being imported; deciding once its code has run", name)
        elif not inflight.initializing(module):
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
        return "patched"
    if library.lost():
        return "unpatched"
    if library.pending:
        return "not needed" if version is not None and decide.before_parametrize(version) else "armed"
    if library.switched_off:
        return "off"
    if library.failed or library.verdict is None or library.verdict.unexpected:
        return "skipped"
    return "not needed"


def _derive_state(library: _Library, version: str | None) -> str:
    """The one word for ``Status.state``: any library unpatched since, any patched, or bitsandbytes'."""
    states = [_library_state(other, other.target.version()) for other in _state.libraries.values()]
    if "unpatched" in states:
        return "unpatched"
    if "patched" in states:
        return "patched"
    return _library_state(library, version)


def _verdict(library: _Library) -> decide.Verdict | None:
    """The decision on the library's module; made only to report where the fix did not decide (off).

    Reporting runs the same probe as the decision (the library's own function on a throwaway
    module) and patches nothing.
    """
    if library.verdict is not None:
        return library.verdict
    module = library.module()
    if module is None or inflight.initializing(module):
        return None
    if library.seen is None or library.seen_module != id(module):
        try:
            library.seen = decide.judge(module, force=boot.mode() == boot.FORCE, target=library.target)
        except Exception:  # status() never raises
            return None
        library.seen_module = id(module)
    return library.seen


def bitsandbytes_verdict() -> decide.Verdict | None:
    """The decision on ``bitsandbytes.nn.parametrize`` (made to report only, where the fix is off)."""
    return _verdict(_state.bitsandbytes)


def _library_reason(library: _Library) -> str:
    return _lost_reason(library) if library.lost() else library.reason


def _cache_now() -> tuple[int | None, int | None]:
    """torch's counter and the bytes its cache holds, without importing torch (None, None)."""
    if "torch.nn.utils.parametrize" not in sys.modules:
        return None, None
    try:
        from bnb_gc_fix import gate

        return gate.counter(), gate.cached_bytes()
    except Exception:  # status() never raises
        return None, None


def _library_status(library: _Library, reason: str) -> LibraryStatus:
    verdict = _verdict(library)
    return LibraryStatus(
        name=library.target.name,
        version=library.target.version(),
        affected=None if verdict is None else verdict.affected,
        patched=library.applied(),
        reason=reason,
    )


def status() -> Status:
    """Where the fix stands in this process right now."""
    bnb = _state.bitsandbytes
    verdict = _verdict(bnb)
    version = decide.bitsandbytes_version()
    reason = _library_reason(bnb)
    if bnb.pending:
        reason = _pending_reason(version) or reason
    counter, cache_bytes = _cache_now()
    if not gil_enabled():
        reason = f"{reason}. {UNTESTED_FREE_THREADING}"
    return Status(
        active=bnb.applied(),
        reason=reason,
        bitsandbytes=version,
        torch=decide.torch_version(),
        pending=bnb.pending,
        affected=None if verdict is None else verdict.affected,
        probe=None if verdict is None else verdict.probe,
        mode=boot.mode(),
        switch=_env_value(),
        via=_state.via if _state.on() else None,
        libraries=tuple(
            _library_status(library, reason if library is bnb else _library_reason(library))
            for library in _state.libraries.values()
            if library.verdict is not None or library.target.imported()
        ),
        cell_end_release=notebook.installed(),
        state=_derive_state(bnb, version),
        counter=counter,
        cache_bytes=cache_bytes,
    )


UNTESTED_FREE_THREADING = (
    "Caution: this Python runs without the GIL (a free-threaded build); the fix then gates with "
    "a lock (_LockedGate), a path never tested on such a build"
)


def gil_enabled() -> bool:
    """False on a free-threaded build running without the GIL (``sys._is_gil_enabled()``)."""
    return bool(getattr(sys, "_is_gil_enabled", lambda: True)())


def _pending_reason(bnb: str | None) -> str | None:
    """A truer sentence than "waiting" when what the patch waits for can never come."""
    if bnb is not None:
        if decide.before_parametrize(bnb):
            return f"{decide.no_parametrize(bnb)}; nothing to patch"
        return None
    if "bitsandbytes" in sys.modules:
        return None
    from importlib.machinery import PathFinder

    if PathFinder.find_spec("bitsandbytes") is None:
        return (
            "armed: bitsandbytes is not installed, so there is nothing to patch now; the fix "
            "checks and patches it if it is imported later"
        )
    return None


def activate_on_import() -> None:
    """What ``import bnb_gc_fix`` does: activate, crediting the start-up hook or runner if they did it."""
    watcher = boot.installed_watcher()
    via = boot.trigger or (watcher.via if watcher is not None else "import")
    activate(via=via)
