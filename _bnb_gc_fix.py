"""bnb-gc-fix's start-up hook, and the facts it needs before the package ``bnb_gc_fix`` may be imported.

Every Python process of the environment imports this module at start (``zz_bnb_gc_fix.pth``, or
``zz_bnb_gc_fix.start`` where Python runs start-up entry points) and calls :func:`install`. It imports
nothing but ``os`` and ``sys``, which every interpreter has loaded already: the package itself (logging,
packaging, wrapt) is imported only in a process that imports a watched module.
"""

import os
import sys

TYPE_CHECKING = False  # typing is not imported at start-up; mypy reads this as True
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

PACKAGE = "bnb_gc_fix"
VARIABLE = "BNB_GC_FIX"

# The switch's modes, each with the values of BNB_GC_FIX that ask for it (trimmed, any case; unset: auto).
AUTO = "auto"  # the fix goes into every library whose hooks leak this way
OFF = "off"
FORCE = "force"  # also into hooks it knows that do not leak this way, for what a Ctrl-C leaves there
SPELLINGS = {
    AUTO: ("", "auto", "1", "on", "true", "yes"),
    OFF: ("0", "off", "false", "no"),
    FORCE: ("force",),
}


def mode_of(value: "str | None") -> "str | None":
    """The mode a value of BNB_GC_FIX asks for (None: unset, so auto); None for a value not in SPELLINGS."""
    spelling = "" if value is None else value.strip().lower()
    for mode, spellings in SPELLINGS.items():
        if spelling in spellings:
            return mode
    return None


def switched_off() -> bool:
    return mode_of(os.environ.get(VARIABLE)) == OFF


#: The libraries' modules that register the leaking pair, bitsandbytes' first (``bnb_gc_fix.libraries``
#: takes them from here and says the rest of each library).
WATCHED = ("bitsandbytes.nn.parametrize", "axolotl.monkeypatch.moe_quant")

#: True once the start-up hook ran in this process (it does not where Python skips `.pth` files).
started = False
#: True while the start-up hook imports the package: the watcher then finds it where this module was
#: installed (never a `bnb_gc_fix.py` in the working directory), and the package knows who turned it on.
importing_package = False
#: The watched modules whose code a watcher's loader is running: not to be patched half-made.
executing: "set[str]" = set()


class Watcher:
    """A finder first on ``sys.meta_path`` that finds nothing itself. For a watched module it returns what
    the finders after it find, with a loader that turns the fix on once the module's code has run."""

    def find_spec(
        self, name: str, path: "Sequence[str] | None" = None, target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if name == PACKAGE and importing_package:
            return _installed_package_spec()
        if name not in WATCHED:
            return None
        try:
            spec = _spec_from_later_finders(self, name, path, target)
        except Exception:  # a later finder failed: the import system asks it again, and says so
            return None
        loader = None if spec is None else spec.loader
        if loader is not None and hasattr(loader, "exec_module") and not isinstance(loader, TurningOnLoader):
            spec.loader = TurningOnLoader(loader)  # type: ignore[union-attr]
        return spec


class TurningOnLoader:
    """A watched module's loader: the real one (every other attribute is the real one's), then the fix."""

    def __init__(self, loader: "Loader") -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> "object":
        if name == "loader":  # a copy made without __init__
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        return self.loader.create_module(spec)

    def exec_module(self, module: "ModuleType") -> None:
        spec = module.__spec__
        if spec is not None and getattr(spec, "loader", None) is self:  # anyone sees the real loader
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        name = module.__name__
        executing.add(name)
        try:
            self.loader.exec_module(module)
        finally:
            executing.discard(name)
        import_the_package_for(name)


def _spec_from_later_finders(
    watcher: Watcher, name: str, path: "Sequence[str] | None", target: "ModuleType | None"
) -> "ModuleSpec | None":
    finders: list[object] = list(sys.meta_path)  # a copy: the import system may be iterating the list
    later = finders[finders.index(watcher) + 1 :] if watcher in finders else []
    for finder in later:
        find_spec = getattr(finder, "find_spec", None)
        spec: ModuleSpec | None = None if find_spec is None else find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


def _installed_package_spec() -> "ModuleSpec | None":
    from importlib.machinery import PathFinder

    folder = os.path.dirname(os.path.abspath(__file__))
    return PathFinder.find_spec(PACKAGE, [folder])


def import_the_package_for(name: str) -> None:
    """A watched module has been imported: import the package (which turns the fix on) unless BNB_GC_FIX
    switches it off now, and have it decide for that module. Never raises into the user's import."""
    global importing_package
    if PACKAGE not in sys.modules and switched_off():
        return
    try:
        importing_package = True
        try:
            __import__(PACKAGE)
        finally:
            importing_package = False
        sys.modules[PACKAGE + ".activation"].imported(name)
    except Exception:  # a broken installation: the module imports as if the fix were not installed
        pass


def watch() -> None:
    """Put a watcher first on ``sys.meta_path`` unless one is on it already."""
    if not any(isinstance(finder, Watcher) for finder in sys.meta_path):
        sys.meta_path.insert(0, Watcher())


def install() -> None:
    """The start-up hook: unless BNB_GC_FIX switches the fix off, watch, and turn the fix on at once for
    a watched module imported already. Prints nothing, raises nothing."""
    global started
    started = True
    try:
        if switched_off():
            return
        watch()
        for name in WATCHED:
            if name in sys.modules:
                import_the_package_for(name)
    except Exception:
        pass
