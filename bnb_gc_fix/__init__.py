"""bnb-gc-fix: stop bitsandbytes' 4-bit parametrization cache from leaking under gradient checkpointing.

Importing this package activates the fix (unless ``BNB_GC_FIX`` switches it off). The public API:
:func:`activate`, :func:`deactivate`, :func:`status`, :func:`repair`, :func:`reset`, :class:`guard`.

PYTEST_DONT_REWRITE (pytest's marker: a process may import this package before pytest starts).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import _bnb_gc_fix as _words
from _bnb_gc_fix import cache as _cache
from _bnb_gc_fix import startup as _startup
from bnb_gc_fix import activation as _activation
from bnb_gc_fix._version import __version__
from bnb_gc_fix.activation import deactivate
from bnb_gc_fix.errors import (
    BnbGcFixWarning,
    CacheLeakError,
    CacheLeakWarning,
    PatchSkippedWarning,
    SwitchValueWarning,
)
from bnb_gc_fix.errors import logger as _logger
from bnb_gc_fix.guard import guard
from bnb_gc_fix.status import LibraryStatus, Status, status  # `status` is the function, not the module

if TYPE_CHECKING:
    import torch

__all__ = [
    "BnbGcFixWarning",
    "CacheLeakError",
    "CacheLeakWarning",
    "LibraryStatus",
    "PatchSkippedWarning",
    "Status",
    "SwitchValueWarning",
    "__version__",
    "activate",
    "deactivate",
    "guard",
    "repair",
    "reset",
    "status",
]

_logger.addHandler(logging.NullHandler())


def activate() -> Status:
    """Turn the fix on as ``BNB_GC_FIX`` says now (read once per activation); idempotent, never raises (a
    problem becomes a warning and ``status().reason``). Returns :func:`status`."""
    _activation.activate()
    return status()


def repair(model: torch.nn.Module) -> int:
    """Give every module of ``model`` quantized before the fix was active one gate in place of its plain
    pairs (right pairs only under ``BNB_GC_FIX=force``); returns how many modules changed. A counter
    already stuck stays stuck: :func:`reset` releases it."""
    from bnb_gc_fix import hooks

    force = _activation.forcing()
    changed = [hooks.install(module, replace_always_called=force) for module in model.modules()]
    return sum(changed)


def reset() -> int:
    """Release a stuck parametrization cache: counter to 0, cache emptied, every gate's holds forgotten.
    Returns the holds released. Works whether or not the fix is active, and never imports torch."""
    return _cache.reset()


# Importing the package turns the fix on. A start-up path notes itself just before it imports the
# package; a user's own import finds no such note.
_activation.activate(via=_startup.activated_by or _words.VIA_IMPORT)
