"""Importing what the commands need, with a clear word for what fails: not installed, or installed but
broken (a bitsandbytes raising at import for a missing CUDA library is broken, never missing)."""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata
from types import ModuleType


def distribution_version(name: str) -> str | None:
    """The installed distribution's version, from its metadata (nothing imported), or None."""
    try:
        return metadata.version(name)
    except Exception:  # not installed, or metadata that cannot be read
        return None


def has_module(name: str) -> bool:
    """Whether the module ``name`` exists, its package imported already (a release from before the library
    had it has none); nothing is imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:  # a package that is not one, or a finder that fails: import it to say what is wrong
        return True


def try_import(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)``, or ``(None, what went wrong)``. A broken install can raise anything, SystemExit
    included; only KeyboardInterrupt goes through."""
    try:
        return importlib.import_module(name), None
    except (Exception, SystemExit) as error:
        top = name.split(".")[0]
        if isinstance(error, ModuleNotFoundError) and error.name == top:
            return None, f"{top} is not installed"
        version = distribution_version(top)
        installed = f"{top} {version} is installed" if version else f"{top} is installed"
        what = "" if name == top else f"{name} "
        return None, f"{installed} but {what}fails to import ({type(error).__name__}: {error})"
