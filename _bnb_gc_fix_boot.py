"""Start-up bootstrap for bnb-gc-fix: standard library only, imported by ``bnb_gc_fix.pth``.

This module lives outside the ``bnb_gc_fix`` package on purpose: importing the package
pulls in wrapt and packaging (tens of milliseconds), and every Python process on the machine
runs the ``.pth`` line. Importing this file touches only ``os``, ``sys`` and ``_thread``, which the
interpreter has already loaded by the time ``site`` processes ``.pth`` files.

What it does at start-up: read ``BNB_GC_FIX`` and, unless it switches the fix off, put a tiny
finder at the front of ``sys.meta_path``. The finder changes nothing any import finds. When
``bitsandbytes`` is executed, it imports ``bnb_gc_fix`` just before bitsandbytes' code runs;
that import activates the fix (a post-import hook that patches ``bitsandbytes.nn.parametrize``
when that module loads). Processes that never import bitsandbytes pay for one list insertion and
one set look-up per import.

It is also the one place that knows the ``BNB_GC_FIX`` vocabulary, so the package and the
start-up hook can never disagree about what a value means.
"""

# No `from __future__ import annotations` here: the __future__ module is not loaded at start-up,
# and importing it would cost every Python process. Annotations that need it are quoted.
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

#: The modules the package patches (``bnb_gc_fix.targets.TARGETS``; a test checks that they agree).
#: The watcher wraps their loaders too, so that one being imported when the fix activates (axolotl's
#: ``moe_quant`` imports bitsandbytes at its top) is decided once its code has run.
_TARGET_MODULES = ("bitsandbytes.nn.parametrize", "axolotl.monkeypatch.moe_quant")
_WATCHED = frozenset((_TRIGGERED_MODULE, *_TARGET_MODULES))

#: Which start-up path ran in this process ("start-up hook" or "runner"), whether or not
#: ``BNB_GC_FIX`` then switched the fix off; ``None`` when neither ran.
started_by: "str | None" = None

#: The start-up path whose finder fired ("start-up hook" or "runner"): it saw bitsandbytes' code
#: about to run and imported ``bnb_gc_fix``; ``None`` while it has not fired.
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


def forces(mode: str) -> bool:
    """What ``force`` means, in one place: gate also where the pair is already right (upstream's
    always-called pair, bitsandbytes 0.50), for the gate's Ctrl-C healing."""
    return mode == FORCE


class BitsandbytesWatcher:
    """A meta-path finder that activates bnb-gc-fix just before bitsandbytes' code first runs.

    It never changes what an import finds, and it never changes ``sys.meta_path`` (the import
    system may be iterating it): for a watched module (bitsandbytes, and the modules the package
    patches) it asks the finders after it, in order, exactly as the import system would, and
    returns their spec with its loader wrapped (:class:`_WatchingLoader`). The fix activates when
    that loader executes bitsandbytes, by whatever path (``import``, ``importlib.util.LazyLoader``,
    ``module_from_spec`` and ``exec_module``); a lookup alone (``importlib.util.find_spec``, as
    ``transformers`` does to see whether bitsandbytes is installed) activates nothing.
    """

    bnb_gc_fix_watcher = True

    def __init__(self, via: str) -> None:
        self.via = via
        self.fired = False

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname not in _WATCHED:
            return None
        try:
            spec = self._spec_after_me(fullname, path, target)
        except Exception:  # a later finder failed: the import system will ask it again and say so
            spec = None
            if fullname == _TRIGGERED_MODULE:
                self.fire()
        if spec is None or isinstance(spec.loader, _WatchingLoader):
            return spec
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _WatchingLoader(spec.loader, fullname, self)
        elif fullname == _TRIGGERED_MODULE:
            self.fire()  # a spec we cannot wrap: activate now, as the import is about to load it
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


if TYPE_CHECKING:
    from importlib.abc import Loader as _LoaderBase
else:
    _LoaderBase = object  # importlib.abc is not loaded at start-up; the protocol needs no base class


class _WatchingLoader(_LoaderBase):
    """The loader of a watched module's spec: the real one, and a word to us when it executes.

    It follows the loader protocol (``create_module``, ``exec_module``; anything else is the real
    loader's), as wrapt's post-import hooks wrap a loader. ``exec_module`` first puts the real loader
    back on the module and its spec, so nothing anyone sees changes; for bitsandbytes it activates the
    fix before the module's code runs; after the code ran to its end it calls back whoever asked
    (:func:`when_complete`).
    """

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
                callbacks = _CALLBACKS.pop(self.name, []) if completed else []
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # never break the user's import
                    pass


_LOCK = _thread.allocate_lock()


def _renew_lock() -> None:
    global _LOCK
    _LOCK = _thread.allocate_lock()  # a forked child never waits on a lock a parent thread held


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)
_EXECUTING: "set[str]" = set()
_CALLBACKS: "dict[str, list[Callable[[], None]]]" = {}


def when_complete(name: str, callback: "Callable[[], None]") -> bool:
    """Call ``callback()`` once the module ``name``, executing through the watcher's loader right now,
    has run to its end (after a failure: once its next import has). False when ``name`` is not
    executing through the watcher's loader (no start-up hook, or another finder answered for it);
    the callback is then never called. Callbacks run outside the import's error path: they must not
    raise, and what they raise is dropped.
    """
    with _LOCK:
        if name not in _EXECUTING:
            return False
        _CALLBACKS.setdefault(name, []).append(callback)
        return True


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
