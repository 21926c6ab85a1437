"""What is installed, and what imports, for ``bnb-gc-fix status`` and ``check``: a broken install (a
bitsandbytes raising ``RuntimeError("CUDA Setup failed ...")`` or an ``OSError`` for a missing CUDA
library at import) is named as broken, never as missing. Every import here catches whatever it raises.
"""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from types import ModuleType


def distribution_version(name: str) -> str | None:
    """The installed distribution's version (from its metadata, without importing it), or None."""
    try:
        return metadata.version(name)
    except Exception:  # not installed, or metadata that cannot be read
        return None


def findable(name: str) -> bool:
    """Whether an import of the top-level module ``name`` would find something on ``sys.path``. Reads
    ``sys.path`` (and its finders' caches) only: nothing is imported, no library code runs."""
    from importlib.machinery import PathFinder

    try:
        return PathFinder.find_spec(name) is not None
    except Exception:  # an odd sys.path entry: say it may be there
        return True


def absent(name: str) -> bool:
    """Whether the top-level module ``name`` is not installed: not imported, and either the last
    :func:`try_import` of it found it missing or an import would find nothing on ``sys.path``."""
    if name in sys.modules:
        return False
    return missing(name) or not findable(name)


def _not_installed(name: str, error: BaseException) -> bool:  # whatever stale metadata may say
    return isinstance(error, ModuleNotFoundError) and error.name == name.split(".")[0]


def failure(name: str, error: BaseException) -> str:
    """What a failed import of ``name`` means: not installed, or installed and broken (and how)."""
    top = name.split(".")[0]
    if _not_installed(name, error):
        return f"{top} is not installed"
    version = distribution_version(top)
    installed = f"{top} {version} is installed" if version else f"{top} is installed"
    what = "" if name == top else f"{name} "
    return f"{installed} but {what}fails to import ({type(error).__name__}: {error})"


_failures: dict[str, str] = {}
_missing: set[str] = set()


def missing(name: str) -> bool:
    """Whether the last :func:`try_import` of ``name`` failed because it is not installed."""
    return name in _missing


def failures() -> dict[str, str]:
    """Every failed :func:`try_import` of this process: module name -> what went wrong."""
    return dict(_failures)


def try_import(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` or ``(None, what went wrong)``, remembered for ``status().import_errors``. A broken
    install can raise anything at import, ``SystemExit`` included; only ``KeyboardInterrupt`` goes through."""
    try:
        module = importlib.import_module(name)
    except (Exception, SystemExit) as error:
        _failures[name] = problem = failure(name, error)
        if _not_installed(name, error):
            _missing.add(name)
        return None, problem
    _failures.pop(name, None)
    _missing.discard(name)
    return module, None


def import_installed() -> None:
    """Import what the fix decides on, as far as it imports: torch, bitsandbytes' 4-bit module, and
    the patched module of every installed look-alike library. Failures are remembered, never raised."""
    from importlib.util import find_spec

    from _bnb_gc_fix import BITSANDBYTES, LIBRARIES
    from bnb_gc_fix.decide import before_parametrize

    torch, _ = try_import("torch")
    if torch is None:
        return
    bitsandbytes, _ = try_import("bitsandbytes")
    version = str(getattr(bitsandbytes, "__version__", "unknown"))  # unknown: try its parametrize
    if bitsandbytes is not None and not before_parametrize(version):
        try_import(BITSANDBYTES.module)
    for library in LIBRARIES:
        if library is BITSANDBYTES:
            continue
        try:
            if find_spec(library.name) is None:
                continue
        except (Exception, SystemExit) as error:
            _failures[library.name] = failure(library.name, error)
            continue
        try_import(library.module)
