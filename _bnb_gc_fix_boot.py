"""The start-up hook of bnb-gc-fix: a finder on ``sys.meta_path`` that activates the fix the moment
bitsandbytes' code is about to run. Standard library only.

Every Python process of the environment runs it: ``bnb_gc_fix.pth`` imports it and calls
:func:`install_quietly` (``bnb_gc_fix.start`` names the same function for Pythons that run start-up
entry points instead of ``.pth`` import lines), and so does the runner's ``sitecustomize``. It lives
outside the package on purpose: importing the package pulls in wrapt and packaging (tens of
milliseconds). At start-up this file imports only ``_bnb_gc_fix_vocabulary`` and modules the
interpreter has already loaded.

The path from interpreter start to a gated module (``docs/how-it-works.md`` draws it):

1. :func:`install` reads ``BNB_GC_FIX`` and, unless it switches the fix off, puts a
   :class:`BitsandbytesWatcher` first on ``sys.meta_path``.
2. When bitsandbytes is about to execute (its loader's ``exec_module``; or at once, where it is
   imported already or its spec cannot be wrapped), the watcher imports the package from this file's
   own folder (:func:`import_ours`); the package's last line activates the fix
   (``bnb_gc_fix/activation.py``).
3. Activation asks ``_bnb_gc_fix_imports.when_imported`` to call back once
   ``bitsandbytes.nn.parametrize`` has run, then decides (``decide.py``) and patches (``patch.py``).
4. Every module quantized from then on gets a gate (``hooks.py`` puts it in place of the plain pair,
   ``gate.py`` is the gate).

Every failure on this path is silent here; ``bnb-gc-fix status`` says what happened.
"""

# No `from __future__ import annotations`: see _bnb_gc_fix_vocabulary.
import os
import sys

import _bnb_gc_fix_vocabulary as vocabulary

TYPE_CHECKING = False  # typing is not loaded at start-up either; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

#: The folder this file was installed in, where the package and our other top-level modules live.
HERE = os.path.dirname(os.path.abspath(__file__))
#: Our top-level modules, loaded from :data:`HERE` before the package, which imports them by name.
_OUR_MODULES = ("_bnb_gc_fix_vocabulary", "_bnb_gc_fix_imports", "_bnb_gc_fix_cache")

#: Which start-up path ran in this process (a ``vocabulary.VIA_*`` value), whether or not
#: ``BNB_GC_FIX`` then switched the fix off; None when neither ran.
started_by: "str | None" = None
#: The start-up path whose watcher fired (saw bitsandbytes' code about to run); None until one has.
trigger: "str | None" = None


def import_ours(name: str) -> "ModuleType":
    """Our module ``name`` from :data:`HERE`, never a same-named module earlier on ``sys.path`` (a
    ``bnb_gc_fix.py`` in the working directory, say). One already imported is returned as it is.

    This is importlib's own recipe for importing from a given place: find the spec, make the module,
    put it in ``sys.modules``, execute it, and take it (and any of its submodules) out again if that
    raises. At start-up, when ``site`` runs ``bnb_gc_fix.pth``, the working directory is not yet on
    ``sys.path``, so this file and the vocabulary come from the installation too.
    """
    imported = sys.modules.get(name)
    if imported is not None:
        return imported
    import importlib.util
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec(name, [HERE])
    if spec is None or spec.loader is None:
        raise ImportError(f"{name} is not installed in {HERE}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for imported_name in [key for key in sys.modules if key == name or key.startswith(name + ".")]:
            sys.modules.pop(imported_name, None)
        raise
    return sys.modules[name]


def is_watcher(finder: object) -> bool:
    """Whether ``finder`` is one of ours (the start-up hook's, the runner's or activation's)."""
    return bool(getattr(finder, "bnb_gc_fix_watcher", False))


class BitsandbytesWatcher:
    """A meta-path finder that changes neither what an import finds nor ``sys.meta_path``.

    For a watched module it asks the finders after it, as the import system would, and returns their
    spec with its loader wrapped (:class:`WatchingLoader`). The fix activates when that loader executes
    bitsandbytes, by any path (``import``, ``LazyLoader``, ``exec_module``); a lookup alone
    (``importlib.util.find_spec``, as transformers does) activates nothing. ``via`` is None for the
    watcher activation puts first (it reports and activates nothing itself).
    """

    bnb_gc_fix_watcher = True  # how every copy of this file recognises a watcher (see is_watcher)

    def __init__(self, via: "str | None") -> None:
        self.via = via
        self.fired = False

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname not in vocabulary.WATCHED:
            return None
        try:
            spec = self._spec_from_later_finders(fullname, path, target)
        except Exception:  # a later finder failed: the import system will ask it again and say so
            if fullname == vocabulary.TRIGGER:
                self.fire()
            return None
        if spec is None or isinstance(spec.loader, WatchingLoader):
            return spec
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = WatchingLoader(spec.loader, fullname, self)  # type: ignore[assignment]
        elif fullname == vocabulary.TRIGGER:
            self.fire()  # a spec we cannot wrap: activate now, as the import is about to load it
        return spec

    def _spec_from_later_finders(
        self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None"
    ) -> "ModuleSpec | None":
        """What the finders after this one answer, asked in order as the import system asks them."""
        finders: list[Any] = list(sys.meta_path)  # a copy: the import system may be iterating it
        later = finders[finders.index(self) + 1 :] if self in finders else []
        for finder in later:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def fire(self) -> None:
        """Import the package from :data:`HERE`, which activates the fix; once only. Never raises into
        the importer: a broken install must never break ``import bitsandbytes``."""
        global trigger
        if self.fired or self.via is None:
            return
        self.fired = True
        trigger = self.via  # read by the package's activation, during the import below
        try:
            for name in _OUR_MODULES:
                import_ours(name)
            import_ours("bnb_gc_fix")  # its last line activates the fix
        except Exception:  # a broken install: bitsandbytes imports as if we were not here
            trigger = None  # nothing was turned on: a later `import bnb_gc_fix` is the user's


class WatchingLoader:  # no importlib.abc.Loader base: not loaded at start-up, and the protocol needs none
    """A watched module's loader: the real one, and a word to us when it executes.

    ``create_module``, ``exec_module`` and anything else are the real loader's. ``exec_module`` first
    puts the real loader back on the module and its spec, so nothing anyone sees changes; for
    bitsandbytes it activates the fix before the module's code runs; once the code has run to its end
    it tells the post-import registry (``_bnb_gc_fix_imports``), which runs what activation asked for.
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
        if create is None:
            return None
        return create(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: "ModuleType") -> None:
        self._put_real_loader_back(module)
        if self.name == vocabulary.TRIGGER:
            self.watcher.fire()
        registry = _registry()
        if registry is None:  # our files are broken: load the module as if we were not here
            self.loader.exec_module(module)
            return
        registry.started(self.name)
        completed = False
        try:
            self.loader.exec_module(module)
            completed = True
        finally:
            registry.finished(self.name, completed)

    def _put_real_loader_back(self, module: "ModuleType") -> None:
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "loader", None) is self:
            spec.loader = self.loader  # type: ignore[union-attr]
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader


def _registry() -> "Any":
    """The post-import registry (``_bnb_gc_fix_imports``), loaded from :data:`HERE`; None if it fails."""
    try:
        return import_ours("_bnb_gc_fix_imports")
    except Exception:
        return None


def installed_watcher() -> "BitsandbytesWatcher | None":
    """The start-up hook's or the runner's watcher on ``sys.meta_path``, if one was installed."""
    for finder in sys.meta_path:
        if is_watcher(finder) and getattr(finder, "via", None) is not None:
            return finder  # type: ignore[return-value]
    return None


def install(via: str = vocabulary.VIA_STARTUP_HOOK) -> bool:
    """Arrange for the fix to activate when bitsandbytes is first executed (at once if it already is).
    Returns False when ``BNB_GC_FIX`` switches the fix off. Safe to call more than once."""
    global started_by
    started_by = via
    mode, _ = vocabulary.parse(os.environ.get(vocabulary.VARIABLE))
    if mode == vocabulary.OFF:
        return False
    if installed_watcher() is not None:
        return True
    watcher = BitsandbytesWatcher(via)
    sys.meta_path.insert(0, watcher)
    if vocabulary.TRIGGER in sys.modules:
        watcher.fire()
    return True


def install_quietly(via: str = vocabulary.VIA_STARTUP_HOOK) -> None:
    """The entry point of ``bnb_gc_fix.pth``, ``bnb_gc_fix.start`` and the runner: prints nothing,
    raises nothing, and may be called with no arguments."""
    try:
        install(via)
    except Exception:
        pass
