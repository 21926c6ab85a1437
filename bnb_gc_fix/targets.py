"""The libraries this package patches: each registers the leaking pair (a pre-hook switching torch's
parametrization cache on, a *plain* forward hook, skipped when the forward raises, switching it off).
To cover the next look-alike, add its :class:`Target` to :data:`TARGETS` and its module to the start-up
hook's ``_TARGET_MODULES`` (a test checks that they agree).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _probe_bitsandbytes() -> tuple[Any, ...]:
    import torch

    return (torch.nn.Module(), "weight")  # the register function takes (module, param_name)


def _probe_axolotl() -> tuple[Any, ...]:
    import torch

    # replace_parameter_8bit quantizes the parameter first: a tiny 2-D CPU tensor (bitsandbytes'
    # CPU int8 quantizer takes 2-D tensors only), on a throwaway module.
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(2, 4), requires_grad=False)
    return (module, "weight")


@dataclass(frozen=True)
class Target:
    """One library whose code registers the leaking cache pair, and how to patch it."""

    name: str  # the library (its top-level package), as users know it
    module: str  # the module holding the functions to wrap; patched when it is imported
    register: str  # registers the pair on its first argument, a module; wrapped to install the gate
    signatures: tuple[tuple[str, int], ...]  # (function, positional arguments): checked before wrapping
    probe_args: Callable[[], tuple[Any, ...]]  # a probe call's arguments: a throwaway module, ...
    # The affected range, in one place. Whether to patch an imported module is the probe's decision; the
    # range is what status() and `check` compare it with, and (for bitsandbytes) first_affected is the
    # first release with a parametrize module at all: before it there is nothing to patch.
    first_affected: str
    first_fixed: str  # the first release whose disable hook is always-called (upstream's fix)
    clamp: str | None = None  # a disable function wrapped so that a direct call never goes below zero

    def version(self) -> str | None:
        """``<name>.__version__`` if the library is imported (never imports it)."""
        version = getattr(sys.modules.get(self.name), "__version__", None)
        return None if version is None else str(version)


BITSANDBYTES = Target(
    name="bitsandbytes",
    module="bitsandbytes.nn.parametrize",
    register="_register_parametrization_hooks",
    signatures=(
        ("_register_parametrization_hooks", 2),
        ("_enable_parametrization_cache", 2),
        ("_disable_parametrization_cache", 3),
    ),
    probe_args=_probe_bitsandbytes,
    first_affected="0.48.0",
    first_fixed="0.50.0",
    clamp="_disable_parametrization_cache",
)

AXOLOTL = Target(
    name="axolotl",
    module="axolotl.monkeypatch.moe_quant",
    register="replace_parameter_8bit",
    signatures=(("replace_parameter_8bit", 2),),
    probe_args=_probe_axolotl,
    first_affected="0.15.0",
    first_fixed="0.20.0",
)

TARGETS: tuple[Target, ...] = (BITSANDBYTES, AXOLOTL)
"""Every patched library; bitsandbytes first (``Status.libraries[0]``)."""
