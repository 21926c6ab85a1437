"""Turning the fix on and off: the environment switch, the lazy post-import hook, and status.

``activate()`` patches ``bitsandbytes.nn.parametrize`` now if it is imported, or registers a
wrapt post-import hook that patches it when it is. Where the installed bitsandbytes is already
right (upstream's fix, found by a probe of its code), it steps aside and says why.
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
from bnb_gc_fix import decide
from bnb_gc_fix.errors import PatchSkippedWarning, SwitchValueWarning

logger = logging.getLogger("bnb_gc_fix")


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
    when nothing else was, "activate()" after a deactivate(); None while the fix is off."""


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.active = False
        self.pending = False
        self.hook_registered = False
        self.reason = "not activated"
        self.verdict: decide.Verdict | None = None
        self.via: str | None = None
        self.warned_switch = False
        self.warned_skip = False


_state = _State()


def _read_switch() -> str:
    raw = os.environ.get(boot.VARIABLE)
    mode, recognised = boot.parse(raw)
    if not recognised and not _state.warned_switch:
        _state.warned_switch = True
        warnings.warn(
            f"{boot.VARIABLE}={raw!r} is not a known value; accepted values are {boot.ACCEPTED}. "
            "Behaving as 'auto'.",
            SwitchValueWarning,
            stacklevel=4,
        )
    return mode


def _apply(parametrize: ModuleType, mode: str) -> None:
    """Decide on an imported bitsandbytes.nn.parametrize and patch it if needed (under the lock)."""
    from bnb_gc_fix import patch

    _state.pending = False
    verdict = decide.judge(parametrize, force=mode == boot.FORCE)
    _state.verdict = verdict
    if verdict.unexpected:
        _state.active = False
        _state.reason = verdict.decision
        if not _state.warned_skip:
            _state.warned_skip = True
            warnings.warn(f"bnb-gc-fix is not active: {verdict.decision}.", PatchSkippedWarning, stacklevel=2)
        return
    if not verdict.patch:
        _state.active = False
        _state.reason = verdict.decision
        log = logger.info if mode == boot.ON else logger.debug
        log("bnb_gc_fix: nothing needed patching: %s", verdict.reason)
        return
    patch.apply(parametrize)
    _state.active = True
    _state.reason = verdict.decision
    logger.info("bnb_gc_fix: %s", verdict.decision)


def _on_parametrize_import(parametrize: ModuleType) -> None:
    """wrapt post-import hook: must never raise, or the user's import fails."""
    try:
        with _state.lock:
            if not _state.pending:  # deactivate() cancelled it
                return
            mode = boot.mode()
            if mode == boot.OFF:  # switched off since activation: the kill switch still holds
                _state.pending = False
                _state.reason = _disabled_reason()
                return
            _apply(parametrize, mode)
    except Exception as error:
        _state.reason = f"patching failed: {type(error).__name__}: {error}; nothing patched"
        warnings.warn(f"bnb-gc-fix is not active: {_state.reason}.", PatchSkippedWarning, stacklevel=2)


def activate(*, via: str = "activate()") -> Status:
    """Turn the fix on: patch bitsandbytes now if imported, else when it is imported.

    Idempotent. With ``BNB_GC_FIX`` set to 0/off/false/no nothing is patched and the status
    says so. Never raises: a problem becomes a warning and ``status().reason``.
    """
    try:
        with _state.lock:
            mode = _read_switch()
            if mode == boot.OFF:
                if not _state.active:  # an earlier patch stays until deactivate()
                    _state.pending = False
                    _state.reason = _disabled_reason()
                return status()
            if _state.via is None or not (_state.active or _state.pending):
                _state.via = via
            if _state.active:
                return status()
            parametrize = sys.modules.get(decide.PARAMETRIZE)
            if parametrize is not None:
                _apply(parametrize, mode)
            else:
                _state.pending = True
                _state.reason = (
                    f"waiting for {decide.PARAMETRIZE} to be imported; it will be checked and patched then"
                )
                if not _state.hook_registered:
                    import wrapt

                    _state.hook_registered = True
                    wrapt.register_post_import_hook(_on_parametrize_import, decide.PARAMETRIZE)
    except Exception as error:
        _state.reason = f"activation failed: {type(error).__name__}: {error}; nothing patched"
        warnings.warn(f"bnb-gc-fix is not active: {_state.reason}.", PatchSkippedWarning, stacklevel=2)
    return status()


def deactivate() -> None:
    """Put bitsandbytes' own functions back and cancel a pending lazy patch.

    Gates already installed on modules keep working; ``repair()`` and ``reset()`` still work.
    """
    from bnb_gc_fix import patch

    with _state.lock:
        parametrize = sys.modules.get(decide.PARAMETRIZE)
        if parametrize is not None:
            patch.remove(parametrize)
        _state.active = False
        _state.pending = False
        _state.reason = "deactivated by deactivate()"


def _env_value() -> str | None:
    return os.environ.get(boot.VARIABLE)


def _disabled_reason() -> str:
    switch = f"{boot.VARIABLE}={_env_value()!r}"
    return f"disabled by the environment: {switch} switches the fix off; nothing patched"


def status() -> Status:
    """Where the fix stands in this process right now."""
    verdict = _state.verdict
    bnb = decide.bitsandbytes_version()
    reason = _state.reason
    if _state.pending:
        reason = _pending_reason(bnb) or reason
    if not gil_enabled():
        reason = f"{reason}. {UNTESTED_FREE_THREADING}"
    return Status(
        active=_state.active,
        reason=reason,
        bitsandbytes=bnb,
        torch=decide.torch_version(),
        pending=_state.pending,
        affected=None if verdict is None else verdict.affected,
        probe=None if verdict is None else verdict.probe,
        mode=boot.mode(),
        switch=_env_value(),
        via=_state.via if (_state.active or _state.pending) else None,
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
            "bitsandbytes is not installed, so there is nothing to patch; the fix stays armed and "
            "patches it if it is imported later"
        )
    return None


def activate_on_import() -> None:
    """What ``import bnb_gc_fix`` does: activate, crediting the start-up hook or runner if they did it."""
    watcher = boot.installed_watcher()
    via = boot.trigger or (watcher.via if watcher is not None else "import")
    activate(via=via)
