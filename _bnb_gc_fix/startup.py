"""The start-up hook: a finder on ``sys.meta_path`` that turns the fix on the moment a patched module
(``bitsandbytes.nn.parametrize``, axolotl's ``moe_quant``) has been imported. Standard library only.

Every Python process of the environment runs it: ``bnb_gc_fix.pth`` imports it and calls
:func:`install_quietly` (``bnb_gc_fix.start`` names the same function for Pythons that run start-up
entry points instead of ``.pth`` import lines), and so does the runner's ``sitecustomize``. Importing
the public package instead would load logging, packaging and importlib.metadata (tens of
milliseconds) in every process.

The path from interpreter start to a gated module (``docs/how-it-works.md`` draws it):

1. :func:`install` reads ``BNB_GC_FIX`` and, unless it switches the fix off, puts a :class:`Watcher`
   first on ``sys.meta_path``.
2. For a watched module the watcher asks the finders after it and wraps the loader they return
   (:class:`WatchingLoader`). Once the module's code has run to its end, the loader imports the public
   package, the one installed beside this package (its last line activates the fix,
   ``bnb_gc_fix/activation.py``), and tells activation, which decides (``decide.py``) and patches
   (``patch.py``).
3. Every module quantized from then on gets a gate (``hooks.py`` puts it in place of the plain pair,
   ``gate.py`` is the gate).

Every failure on this path is silent here; ``bnb-gc-fix status`` says what happened.
"""

import os
import sys

import _bnb_gc_fix as words

TYPE_CHECKING = False  # typing is not loaded at start-up either; mypy reads this name as True
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

#: This package's folder.
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: The folder this package was installed in (site-packages), where the public package lives beside it.
INSTALL_DIR = os.path.dirname(PACKAGE_DIR)

#: Which start-up path ran in this process (a ``words.VIA_*`` value), whether or not ``BNB_GC_FIX``
#: then switched the fix off; None when neither ran.
started_by: "str | None" = None
#: The start-up path that imports, or imported, the public package to turn the fix on; None while none
#: has (then an import of the package is the user's own).
activated_by: "str | None" = None
#: The watched modules whose code a watcher's loader is running right now.
executing: "set[str]" = set()
#: True while a start-up path imports the public package: the watchers then answer for it.
_importing_public = False


def import_public() -> "ModuleType":
    """The public package, imported through the import system (so another thread importing it at the
    same moment waits for it to be whole). While a watcher's start-up import runs, the watchers answer
    for it from :data:`INSTALL_DIR`, so a same-named module earlier on ``sys.path`` (a ``bnb_gc_fix.py``
    in the working directory) never runs."""
    import importlib

    return importlib.import_module(words.PUBLIC)


def _installed_public_spec() -> "ModuleSpec":
    """The public package's spec in :data:`INSTALL_DIR`; it is not there: a broken install."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec(words.PUBLIC, [INSTALL_DIR])
    if spec is None:
        raise ModuleNotFoundError(f"{words.PUBLIC} is not installed in {INSTALL_DIR}", name=words.PUBLIC)
    return spec


def is_watcher(finder: object) -> bool:
    """Whether ``finder`` is one of ours (the start-up hook's, the runner's or activation's)."""
    return bool(getattr(finder, "bnb_gc_fix_watcher", False))


class Watcher:
    """A meta-path finder that changes neither what an import finds (but that, while a start-up path
    imports the public package, it finds the one installed beside this package) nor ``sys.meta_path``.

    For a watched module it asks the finders after it, as the import system would, and returns their
    spec with its loader wrapped (:class:`WatchingLoader`). The fix turns on when that loader has
    executed the module, by any path (``import``, ``LazyLoader``, ``exec_module``); a lookup alone
    (``importlib.util.find_spec``) does nothing. ``via`` is the start-up path that installed it, None
    for the one activation puts first (the package is imported already then).
    """

    bnb_gc_fix_watcher = True  # how a watcher is recognised (see is_watcher)

    def __init__(self, via: "str | None") -> None:
        self.via = via

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname == words.PUBLIC and _importing_public:
            return _installed_public_spec()
        if fullname not in words.WATCHED:
            return None
        try:
            spec = self._spec_from_later_finders(fullname, path, target)
        except Exception:  # a later finder failed: the import system will ask it again and say so
            return None
        if spec is None or isinstance(spec.loader, WatchingLoader):
            return spec
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = WatchingLoader(spec.loader, fullname, self)  # type: ignore[assignment]
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

    def imported(self, name: str) -> None:
        """The watched module ``name`` has run to its end: turn the fix on if no one has (the public
        package's import does), unless ``BNB_GC_FIX`` switches it off now, and let activation patch the
        module. Never raises into the importer: a broken install must never break the user's import."""
        global activated_by, _importing_public
        if words.PUBLIC not in sys.modules and _switched_off():
            return
        try:
            if activated_by is None and words.PUBLIC not in sys.modules:
                activated_by = self.via  # read by the package's activation, during the import below
            _importing_public = True
            import_public()
            activation = sys.modules[words.PUBLIC + ".activation"]
            activation.on_imported(name)
        except Exception:  # a broken install: the module imports as if we were not here
            if words.PUBLIC not in sys.modules:
                activated_by = None  # nothing was turned on: a later `import bnb_gc_fix` is the user's
        finally:
            _importing_public = False


class WatchingLoader:  # no importlib.abc.Loader base: not loaded at start-up, and the protocol needs none
    """A watched module's loader: the real one, and a word to the watcher once it has executed.

    ``create_module``, ``exec_module`` and anything else are the real loader's. ``exec_module`` first
    puts the real loader back on the module and its spec, so nothing anyone sees changes; the module is
    in :data:`executing` while its code runs and until the watcher has heard of it.
    """

    def __init__(self, loader: "Loader", name: str, watcher: Watcher) -> None:
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
        executing.add(self.name)
        try:
            self.loader.exec_module(module)
            self.watcher.imported(self.name)  # only once its code has run to its end
        finally:
            executing.discard(self.name)

    def _put_real_loader_back(self, module: "ModuleType") -> None:
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "loader", None) is self:
            spec.loader = self.loader  # type: ignore[union-attr]
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader


def _switched_off() -> bool:
    mode, _ = words.parse(os.environ.get(words.VARIABLE))
    return mode == words.OFF


def installed_watcher() -> "Watcher | None":
    """The start-up hook's or the runner's watcher on ``sys.meta_path``, if one was installed."""
    for finder in sys.meta_path:
        if is_watcher(finder) and getattr(finder, "via", None) is not None:
            return finder  # type: ignore[return-value]
    return None


def watch_first() -> None:
    """Put a watcher first on ``sys.meta_path`` unless one is first already (a finder put in front of
    the start-up hook's may answer for a watched module). Activation calls this from the user's code or
    from a watched module's loader, never from within the import system's loop over ``sys.meta_path``."""
    first = sys.meta_path[0] if sys.meta_path else None
    if not is_watcher(first):
        sys.meta_path.insert(0, Watcher(via=None))


def install(via: str = words.VIA_STARTUP_HOOK) -> bool:
    """Arrange for the fix to turn on when a watched module is imported (at once for one imported
    already). Returns False when ``BNB_GC_FIX`` switches the fix off. Safe to call more than once."""
    global started_by
    started_by = via
    if _switched_off():
        return False
    if installed_watcher() is not None:
        return True
    watcher = Watcher(via)
    sys.meta_path.insert(0, watcher)
    for name in sorted(words.WATCHED):
        if name in sys.modules:
            watcher.imported(name)
    return True


def install_quietly(via: str = words.VIA_STARTUP_HOOK) -> None:
    """The entry point of ``bnb_gc_fix.pth``, ``bnb_gc_fix.start`` and the runner: prints nothing,
    raises nothing, and may be called with no arguments."""
    try:
        install(via)
    except Exception:
        pass
