"""Start-up bootstrap for bnb-gc-fix: standard library only, imported by ``bnb_gc_fix.pth``.

This module lives outside the ``bnb_gc_fix`` package on purpose: importing the package
pulls in wrapt and packaging (tens of milliseconds), and every Python process on the machine
runs the ``.pth`` line. Importing this file touches only ``os`` and ``sys``, which the
interpreter has already loaded by the time ``site`` processes ``.pth`` files.

What it does at start-up: read ``BNB_GC_FIX`` and, unless it switches the fix off, put a tiny
finder at the front of ``sys.meta_path``. The finder changes nothing any import finds. When
``bitsandbytes`` is imported, it imports ``bnb_gc_fix`` just before bitsandbytes' code runs;
that import activates the fix (a post-import hook that patches ``bitsandbytes.nn.parametrize``
when that module loads). Processes that never import bitsandbytes pay for one list insertion and
one string comparison per import.

It is also the one place that knows the ``BNB_GC_FIX`` vocabulary, so the package and the
start-up hook can never disagree about what a value means.
"""

# No `from __future__ import annotations` here: the __future__ module is not loaded at start-up,
# and importing it would cost every Python process. Annotations that need it are quoted.
import os
import sys

TYPE_CHECKING = False  # typing is not loaded at start-up either; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

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

#: Which start-up path ran in this process ("start-up hook" or "runner"), whether or not
#: ``BNB_GC_FIX`` then switched the fix off; ``None`` when neither ran.
started_by: "str | None" = None

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
    """A meta-path finder that activates bnb-gc-fix just before bitsandbytes' code first runs.

    It never changes what an import finds, and it never changes ``sys.meta_path`` (the import
    system may be iterating it): for ``bitsandbytes`` it asks the finders after it, in order,
    exactly as the import system would, and returns their spec marked so that the fix activates
    when that module starts to execute. A lookup alone (``importlib.util.find_spec``, as
    ``transformers`` does to see whether bitsandbytes is installed) activates nothing. Once
    fired, it answers ``None`` to everything.
    """

    bnb_gc_fix_watcher = True

    def __init__(self, via: str) -> None:
        self.via = via
        self.fired = False

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname != _TRIGGERED_MODULE or self.fired:
            return None
        try:
            spec = self._spec_after_me(fullname, path, target)
        except Exception:  # a later finder failed: the import system will ask it again and say so
            self.fire()
            return None
        if spec is not None and not _fire_on_exec(spec, self):
            self.fire()  # a spec we cannot mark: activate now, as the import is about to load it
        return spec

    def _spec_after_me(
        self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None"
    ) -> "ModuleSpec | None":
        finders: list[object] = list(sys.meta_path)  # a copy: the import system may be iterating it
        try:
            after = finders[finders.index(self) + 1 :]
        except ValueError:
            return None
        for finder in after:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec  # type: ignore[no-any-return]
        return None

    def fire(self) -> None:
        """Import bnb_gc_fix, which activates the fix; once only, and never raises into the importer."""
        global trigger
        if self.fired:
            return
        self.fired = True
        trigger = self.via
        try:
            import bnb_gc_fix  # noqa: F401  (the import activates the fix)
        except Exception:  # a broken install must never break `import bitsandbytes`
            pass


def _fire_on_exec(spec: "ModuleSpec", watcher: BitsandbytesWatcher) -> bool:
    """Mark a plain ``ModuleSpec`` so that ``watcher.fire()`` runs as its module starts to execute.

    The import machinery sets ``spec._initializing = True`` (``importlib._bootstrap._load_unlocked``)
    once the spec was found and right before the module's code runs; the marked class calls back
    then, and puts the plain class back. Returns False for a spec of another class.
    """
    import importlib.machinery

    plain = importlib.machinery.ModuleSpec
    if type(spec) is not plain:
        return False
    object.__setattr__(spec, "_bnb_gc_fix_on_exec", watcher)
    spec.__class__ = _activating_spec_class(plain)
    return True


_ACTIVATING_SPEC: "type | None" = None


def _activating_spec_class(base: type) -> type:
    global _ACTIVATING_SPEC
    if _ACTIVATING_SPEC is None:

        def __setattr__(self: object, name: str, value: object) -> None:  # noqa: N807
            if name == "_initializing" and value:
                object.__setattr__(self, "__class__", base)
                watcher = self.__dict__.pop("_bnb_gc_fix_on_exec", None)
                if watcher is not None:
                    watcher.fire()
            object.__setattr__(self, name, value)

        _ACTIVATING_SPEC = type("_ActivatingSpec", (base,), {"__setattr__": __setattr__})
    return _ACTIVATING_SPEC


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
    global started_by
    started_by = via
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
