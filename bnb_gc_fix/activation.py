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
    state: str = "off"
    """One word a user can act on: "patched" (the fix is on), "armed" (waiting for bitsandbytes'
    4-bit code to be imported, then it decides and patches), "not needed" (this bitsandbytes
    cannot leak this way), "off" (switched off by BNB_GC_FIX or deactivate()), "skipped"
    (bitsandbytes or torch internals did not look as expected; nothing patched, one warning)."""
    counter: int | None = None
    """torch's parametrization-cache counter right now (above 0 after a step is the leak); None
    while torch's parametrize module is not imported (status() never imports it)."""
    cache_bytes: int | None = None
    """Bytes of tensors held by torch's parametrization cache right now; None like ``counter``."""


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
        self.switched_off = False
        self.failed = False


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


def _apply(parametrize: ModuleType, mode: str) -> None:
    """Decide on an imported bitsandbytes.nn.parametrize and patch it if needed (under the lock)."""
    from bnb_gc_fix import patch

    _state.pending = False
    _state.failed = False
    verdict = decide.judge(parametrize, force=mode == boot.FORCE)
    _state.verdict = verdict
    if verdict.unexpected:
        _state.active = False
        _state.reason = verdict.decision
        if not _state.warned_skip:
            _state.warned_skip = True
            _warn(f"bnb-gc-fix is not active: {verdict.decision}.", PatchSkippedWarning)
        return
    if not verdict.patch:
        _state.active = False
        _state.reason = verdict.decision
        log = logger.info if mode == boot.ON else logger.debug
        log("nothing needed patching: %s", verdict.reason)
        return
    patch.apply(parametrize)
    _state.active = True
    _state.reason = verdict.decision
    logger.info("%s", verdict.decision)


def _on_parametrize_import(parametrize: ModuleType) -> None:
    """wrapt post-import hook: must never raise, or the user's import fails."""
    try:
        with _state.lock:
            if not _state.pending:  # deactivate() cancelled it
                return
            mode = boot.mode()
            if mode == boot.OFF:  # switched off since activation: the kill switch still holds
                _state.pending = False
                _state.switched_off = True
                _state.reason = _disabled_reason()
                return
            _apply(parametrize, mode)
    except Exception as error:
        _state.failed = True
        _state.reason = f"patching failed: {type(error).__name__}: {error}; nothing patched"
        _warn(f"bnb-gc-fix is not active: {_state.reason}.", PatchSkippedWarning)


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
                    _state.switched_off = True
                    _state.reason = _disabled_reason()
                return status()
            _state.switched_off = False
            if _state.via is None or not (_state.active or _state.pending):
                _state.via = via
            if _state.active:
                return status()
            parametrize = sys.modules.get(decide.PARAMETRIZE)
            if parametrize is not None:
                _apply(parametrize, mode)
            else:
                _state.pending = True
                _state.failed = False
                _state.reason = _ARMED_REASON
                if not _state.hook_registered:
                    import wrapt

                    _state.hook_registered = True
                    wrapt.register_post_import_hook(_on_parametrize_import, decide.PARAMETRIZE)
    except Exception as error:
        _state.failed = True
        _state.reason = f"activation failed: {type(error).__name__}: {error}; nothing patched"
        _warn(f"bnb-gc-fix is not active: {_state.reason}.", PatchSkippedWarning)
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
        _state.switched_off = True
        _state.reason = "deactivated by deactivate()"


def _env_value() -> str | None:
    return os.environ.get(boot.VARIABLE)


def _disabled_reason() -> str:
    switch = f"{boot.VARIABLE}={_env_value()!r}"
    return f"disabled by the environment: {switch} switches the fix off; nothing patched"


_ARMED_REASON = (
    f"armed: {decide.PARAMETRIZE} is not imported yet (bitsandbytes imports it when a model is "
    "quantized, not at `import bitsandbytes`); the fix checks and patches it the moment it is"
)


def _derive_state(bnb: str | None) -> str:
    """The one word for ``Status.state``, from the flags the transitions above keep."""
    if _state.active:
        return "patched"
    if _state.pending:
        return "not needed" if bnb is not None and decide.before_parametrize(bnb) else "armed"
    if _state.switched_off:
        return "off"
    if _state.failed or _state.verdict is None or _state.verdict.unexpected:
        return "skipped"
    return "not needed"


def _cache_now() -> tuple[int | None, int | None]:
    """torch's counter and the bytes its cache holds, without importing torch (None, None)."""
    if "torch.nn.utils.parametrize" not in sys.modules:
        return None, None
    try:
        from bnb_gc_fix import gate

        return gate.counter(), gate.cached_bytes()
    except Exception:  # status() never raises
        return None, None


def status() -> Status:
    """Where the fix stands in this process right now."""
    verdict = _state.verdict
    bnb = decide.bitsandbytes_version()
    reason = _state.reason
    if _state.pending:
        reason = _pending_reason(bnb) or reason
    counter, cache_bytes = _cache_now()
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
        state=_derive_state(bnb),
        counter=counter,
        cache_bytes=cache_bytes,
    )


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
