"""bnb-gc-fix: torch's parametrization cache, kept from being left on by bitsandbytes' (and axolotl's) hooks
under activation checkpointing and Ctrl-C. Importing the package turns the fix on, unless ``BNB_GC_FIX``
switches it off."""

from __future__ import annotations

import logging

import _bnb_gc_fix as _startup
from bnb_gc_fix import activation as _activation
from bnb_gc_fix import notebook as _notebook
from bnb_gc_fix._version import __version__
from bnb_gc_fix.ledger import reset
from bnb_gc_fix.status import LibraryStatus, Status, status
from bnb_gc_fix.warning import BnbGcFixWarning, PatchSkippedWarning, SwitchValueWarning
from bnb_gc_fix.warning import logger as _logger

__all__ = [
    "BnbGcFixWarning",
    "LibraryStatus",
    "PatchSkippedWarning",
    "Status",
    "SwitchValueWarning",
    "__version__",
    "activate",
    "reset",
    "status",
]

_logger.addHandler(logging.NullHandler())


def activate() -> Status:
    """Turn the fix on as ``BNB_GC_FIX`` says now (idempotent, never raises); returns :func:`status`. The
    fix cannot be switched off in a running process: ``BNB_GC_FIX=0`` from its start is the off switch."""
    _turn_on(via=_activation.ACTIVATE)
    return status()


def _turn_on(via: str) -> None:
    """The fix asked for as the switch says, and with it, in IPython, the cell-end release."""
    _activation.activate(via=via)
    if _activation.fix.asked_by is not None:
        _notebook.install()


_turn_on(via=_activation.STARTUP_HOOK if _startup.importing_package else _activation.IMPORT)
