"""What is installed, and what imports: a broken install is named as broken, never as missing.

The doctor (``bnb-gc-fix status`` and ``check``) imports torch, bitsandbytes and the look-alike
libraries exactly when a user's machine is least healthy: a bitsandbytes that raises
``RuntimeError("CUDA Setup failed ...")`` or an ``OSError`` for a missing CUDA library at import
is installed, and failing. Every import here catches whatever the import raises.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType


def distribution_version(name: str) -> str | None:
    """The installed distribution's version (from its metadata, without importing it), or None."""
    try:
        return metadata.version(name)
    except Exception:  # not installed, or metadata that cannot be read
        return None


def failure(name: str, error: BaseException) -> str:
    """What a failed import of ``name`` means: not installed, or installed and broken (and how)."""
    top = name.split(".")[0]
    if isinstance(error, ModuleNotFoundError) and error.name == top:
        return f"{top} is not installed"  # whatever stale metadata may say: Python cannot find it
    version = distribution_version(top)
    installed = f"{top} {version} is installed" if version else f"{top} is installed"
    what = "" if name == top else f"{name} "
    return f"{installed} but {what}fails to import ({type(error).__name__}: {error})"


def try_import(name: str) -> tuple[ModuleType | None, str | None]:
    """Import ``name``; returns ``(module, None)`` or ``(None, what went wrong)``, never raises.

    A broken install can raise anything at import, ``SystemExit`` included; only
    ``KeyboardInterrupt`` goes through.
    """
    try:
        return importlib.import_module(name), None
    except (Exception, SystemExit) as error:
        return None, failure(name, error)
