"""Start-up hook of bnb-gc-fix, imported by ``bnb_gc_fix.pth`` in every Python process: standard library only.

It lives outside the ``bnb_gc_fix`` package on purpose: importing the package pulls in wrapt and
packaging (tens of milliseconds). Importing this file touches only ``os``, ``sys`` and ``_thread``,
which the interpreter has loaded by the time ``site`` processes ``.pth`` files.

The path from interpreter start to a gated module: (1) :func:`install` reads ``BNB_GC_FIX`` and, unless
it switches the fix off, inserts a :class:`BitsandbytesWatcher` at the front of ``sys.meta_path``;
(2) when bitsandbytes' code is about to run, the watcher's loader imports ``bnb_gc_fix``, whose last
line activates the fix (``bnb_gc_fix/activation.py``); (3) activation asks :func:`when_imported` to call
back once ``bitsandbytes.nn.parametrize`` has run, then decides (``decide.py``) and wraps its functions
(``patch.py``); (4) every module quantized from then on gets a gate (``gate.py``). Every failure on this
path is silent here; ``bnb-gc-fix status`` says what happened. This module is also the one place that
knows the ``BNB_GC_FIX`` vocabulary.
"""

# No `from __future__ import annotations`: the __future__ module is not loaded at start-up, and
# importing it would cost every Python process. Annotations that need it are quoted.
import _thread  # built in, loaded before site runs (the import system's own locks)
import os
import sys

TYPE_CHECKING = False  # typing is not loaded at start-up either; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

VARIABLE = "BNB_GC_FIX"
AUTO, ON, OFF, FORCE = "auto", "on", "off", "force"
_VALUES = {"": AUTO, "auto": AUTO, "force": FORCE}
_VALUES.update(dict.fromkeys(("1", "on", "true", "yes"), ON))
_VALUES.update(dict.fromkeys(("0", "off", "false", "no"), OFF))
ACCEPTED = "auto (or unset), 1/on/true/yes, 0/off/false/no, force"

_TRIGGERED_MODULE = "bitsandbytes"
#: The modules the package patches (``bnb_gc_fix.targets.TARGETS``; a test checks that they agree).
_TARGET_MODULES = ("bitsandbytes.nn.parametrize", "axolotl.monkeypatch.moe_quant")
_WATCHED = frozenset((_TRIGGERED_MODULE, *_TARGET_MODULES))

#: Which start-up path ran in this process ("start-up hook" or "runner"), whether or not
#: ``BNB_GC_FIX`` then switched the fix off; None when neither ran.
started_by: "str | None" = None
#: The start-up path whose finder fired (saw bitsandbytes' code about to run); None until it has.
trigger: "str | None" = None


def parse(raw: "str | None") -> "tuple[str, bool]":
    """``(mode, recognised)`` for a raw ``BNB_GC_FIX`` value (trimmed, case-insensitive; unknown means
    auto, and the caller says so: the start-up hook stays silent, the package warns once)."""
    mode = _VALUES.get("" if raw is None else raw.strip().lower())
    return (AUTO, False) if mode is None else (mode, True)


def forces(mode: str) -> bool:
    """What ``force`` means, in one place: gate also where the pair is already right (upstream's
    always-called pair, bitsandbytes 0.50), for the gate's Ctrl-C healing."""
    return mode == FORCE


class BitsandbytesWatcher:
    """A meta-path finder: for a watched module it asks the finders after it, as the import system would,
    and returns their spec with its loader wrapped (:class:`_WatchingLoader`), changing neither what an
    import finds nor ``sys.meta_path``. The fix activates when that loader executes bitsandbytes, by any
    path (``import``, ``LazyLoader``, ``exec_module``); a lookup alone (``importlib.util.find_spec``, as
    transformers does) activates nothing. ``via`` is None for the package's own watcher."""

    bnb_gc_fix_watcher = True

    def __init__(self, via: "str | None") -> None:
        self.via = via
        self.fired = False

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname not in _WATCHED:
            return None
        spec: ModuleSpec | None = None
        try:
            finders: list[Any] = list(sys.meta_path)  # a copy: the import system may be iterating it
            for finder in finders[finders.index(self) + 1 :] if self in finders else []:
                find_spec = getattr(finder, "find_spec", None)
                spec = None if find_spec is None else find_spec(fullname, path, target)
                if spec is not None:
                    break
        except Exception:  # a later finder failed: the import system will ask it again and say so
            if fullname == _TRIGGERED_MODULE:
                self.fire()
            return None
        if spec is None or isinstance(spec.loader, _WatchingLoader):
            return spec
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WatchingLoader(spec.loader, fullname, self)  # type: ignore[assignment]
        elif fullname == _TRIGGERED_MODULE:
            self.fire()  # a spec we cannot wrap: activate now, as the import is about to load it
        return spec

    def fire(self) -> None:
        """Import bnb_gc_fix, which activates the fix; once only, and never raises into the importer."""
        global trigger
        if self.fired or self.via is None:
            return
        self.fired = True
        trigger = self.via
        try:
            import bnb_gc_fix  # noqa: F401  (the import activates the fix)
        except Exception:  # a broken install must never break `import bitsandbytes`
            pass


class _WatchingLoader:  # no importlib.abc.Loader base: not loaded at start-up, and the protocol needs none
    """A watched module's loader: the real one (``create_module``, ``exec_module``, anything else is the
    real loader's), and a word to us when it executes. ``exec_module`` first puts the real loader back on
    the module and its spec, so nothing anyone sees changes; for bitsandbytes it activates the fix before
    the module's code runs; once the code has run to its end it calls back (:func:`when_imported`)."""

    def __init__(self, loader: "Loader", name: str, watcher: BitsandbytesWatcher) -> None:
        self.loader = loader
        self.name = name
        self.watcher = watcher

    def __getattr__(self, name: str) -> "Any":  # get_filename, get_source, is_package, ...
        if name == "loader":  # not set yet (a copy made without __init__)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: "ModuleType") -> None:
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "loader", None) is self:
            spec.loader = self.loader  # type: ignore[union-attr]
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        if self.name == _TRIGGERED_MODULE:
            self.watcher.fire()
        with _LOCK:
            _EXECUTING.add(self.name)
        completed = False
        try:
            self.loader.exec_module(module)
            completed = True
        finally:
            with _LOCK:
                _EXECUTING.discard(self.name)
                # After a failure the import system drops the half module: wait for the next import.
                callbacks = _CALLBACKS.pop(self.name, set()) if completed else set()
            for callback in callbacks:
                try:
                    callback(self.name)
                except Exception:  # never break the user's import
                    pass


_LOCK = _thread.allocate_lock()
_EXECUTING: "set[str]" = set()
_CALLBACKS: "dict[str, set[Callable[[str], None]]]" = {}


def _renew_lock() -> None:
    global _LOCK
    _LOCK = _thread.allocate_lock()  # a forked child never waits on a lock a parent thread held


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


def when_imported(name: str, callback: "Callable[[str], None]") -> bool:
    """Call ``callback(name)`` once the watched module ``name`` has run to its end through a watcher's
    loader: the import under way now, else the next successful one. A watcher goes first on
    ``sys.meta_path`` unless one is (a finder put in front of the start-up hook's may answer for the
    module; wrapt's post-import hooks do the same). False, and never called, when ``name`` is imported
    already or being imported by a loader no watcher wraps. What a callback raises is dropped; one
    registered twice runs once."""
    if name not in _WATCHED:
        return False
    with _LOCK:
        if name in sys.modules and name not in _EXECUTING:
            return False
        _CALLBACKS.setdefault(name, set()).add(callback)
        if name in _EXECUTING:
            return True
    if not (sys.meta_path and getattr(sys.meta_path[0], "bnb_gc_fix_watcher", False)):
        sys.meta_path.insert(0, BitsandbytesWatcher(None))  # an import's code runs, not a find loop
    return True


def installed_watcher() -> "BitsandbytesWatcher | None":
    """The start-up hook's or the runner's watcher on ``sys.meta_path``, if one installed it."""
    for finder in sys.meta_path:
        if getattr(finder, "bnb_gc_fix_watcher", False) and getattr(finder, "via", None) is not None:
            return finder  # type: ignore[return-value]
    return None


def install(via: str = "start-up hook") -> bool:
    """Arrange for the fix to activate when bitsandbytes is first executed (at once if it already is).
    False when ``BNB_GC_FIX`` switches it off."""
    global started_by
    started_by = via
    if parse(os.environ.get(VARIABLE))[0] == OFF:
        return False
    if installed_watcher() is None:
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
