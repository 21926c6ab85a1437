"""Start-up bootstrap for bnb-gc-fix: standard library only, imported by ``bnb_gc_fix.pth``.

This module lives outside the ``bnb_gc_fix`` package on purpose: importing the package
pulls in wrapt and packaging (tens of milliseconds), and every Python process on the machine
runs the ``.pth`` line. Importing this file touches only ``os`` and ``sys``, which the
interpreter has already loaded by the time ``site`` processes ``.pth`` files.

What it does at start-up: read ``BNB_GC_FIX`` and, unless it switches the fix off, put a tiny
finder at the front of ``sys.meta_path``. The finder never finds anything. The first time
anything asks for ``bitsandbytes`` it removes itself and imports ``bnb_gc_fix``, whose import
activates the fix (a post-import hook that patches ``bitsandbytes.nn.parametrize`` when that
module loads). Processes that never touch bitsandbytes pay for one list insertion.

It is also the one place that knows the ``BNB_GC_FIX`` vocabulary, so the package and the
start-up hook can never disagree about what a value means.
"""

# No `from __future__ import annotations` here: the __future__ module is not loaded at start-up,
# and importing it would cost every Python process. Annotations that need it are quoted.
import os
import sys

VARIABLE = "BNB_GC_FIX"

AUTO = "auto"
ON = "on"
OFF = "off"
FORCE = "force"

_VALUES = {
    "": AUTO,
    "auto": AUTO,
    "1": ON,
    "on": ON,
    "true": ON,
    "yes": ON,
    "0": OFF,
    "off": OFF,
    "false": OFF,
    "no": OFF,
    "force": FORCE,
}

ACCEPTED = "auto (or unset), 1/on/true/yes, 0/off/false/no, force"

_TRIGGERED_MODULE = "bitsandbytes"

#: How the fix was turned on before the package was imported ("start-up hook" or "runner"),
#: set by the finder just before it imports ``bnb_gc_fix``; ``None`` when it has not fired.
trigger: "str | None" = None


def parse(raw: "str | None") -> "tuple[str, bool]":
    """Return ``(mode, recognised)`` for a raw ``BNB_GC_FIX`` value.

    Values are trimmed and case-insensitive. An unrecognised value means ``auto``; the caller
    decides how to say so (the start-up hook must stay silent, the package warns once).
    """
    if raw is None:
        return AUTO, True
    mode = _VALUES.get(raw.strip().lower())
    if mode is None:
        return AUTO, False
    return mode, True


def mode() -> str:
    """The mode the environment asks for right now."""
    return parse(os.environ.get(VARIABLE))[0]


class BitsandbytesWatcher:
    """A meta-path finder that finds nothing and activates bnb-gc-fix before bitsandbytes loads."""

    bnb_gc_fix_watcher = True

    def __init__(self, via: str) -> None:
        self.via = via

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == _TRIGGERED_MODULE:
            self.fire()
        return None

    def fire(self) -> None:
        """Remove this finder and import bnb_gc_fix; never raises into the importer."""
        global trigger
        try:
            sys.meta_path.remove(self)
        except ValueError:
            return
        trigger = self.via
        try:
            import bnb_gc_fix  # noqa: F401  (the import activates the fix)
        except Exception:  # a broken install must never break `import bitsandbytes`
            pass


def installed_watcher() -> "BitsandbytesWatcher | None":
    """The watcher on ``sys.meta_path``, if the start-up hook or the runner installed one."""
    for finder in sys.meta_path:
        if getattr(finder, "bnb_gc_fix_watcher", False):
            return finder  # type: ignore[return-value]
    return None


def install(via: str = "start-up hook") -> bool:
    """Arrange for the fix to activate when bitsandbytes is first imported.

    Returns ``True`` when a watcher is in place (or the fix was activated right away because
    bitsandbytes is already imported), ``False`` when ``BNB_GC_FIX`` switches it off.
    """
    if mode() == OFF:
        return False
    if installed_watcher() is not None:
        return True
    watcher = BitsandbytesWatcher(via)
    sys.meta_path.insert(0, watcher)
    if _TRIGGERED_MODULE in sys.modules:
        watcher.fire()
    return True


def install_quietly(via: str = "start-up hook") -> None:
    """Entry point for ``bnb_gc_fix.pth`` and the runner: prints nothing, raises nothing."""
    try:
        install(via)
    except Exception:
        pass
