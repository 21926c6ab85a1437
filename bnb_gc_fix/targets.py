"""The libraries this package patches, one small description each.

Every library here registers the same leaking pair of hooks around a module's forward: a forward
pre-hook that switches torch's parametrization cache on and a *plain* forward hook that switches it
off (skipped when the forward raises). A :class:`Target` says where that happens and how to probe
it; decide, patch and activation are driven by :data:`TARGETS` alone. To cover the next look-alike,
add one entry.
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

    name: str
    """The library (its top-level package), as users know it."""
    module: str
    """The module holding the functions to wrap; patched when it is imported."""
    register: str
    """The function that registers the pair on its first argument, a module. It is wrapped so that
    every module it registers a plain pair on gets the gate instead; the probe calls the original."""
    signatures: tuple[tuple[str, int], ...]
    """(function, positional arguments it must take): checked before anything is wrapped."""
    probe_args: Callable[[], tuple[Any, ...]]
    """Builds the arguments of a probe call of ``register``; the first is the throwaway module."""
    first_affected: str
    """The first release with the plain pair; with :attr:`first_fixed`, the affected range. Whether to
    patch an imported module is the probe's decision, never the version's; the range says what status()
    and ``check`` report before the module is imported, and what its sentences compare the probe with."""
    first_fixed: str
    """The first release whose disable hook is always-called (upstream's fix)."""
    clamp: str | None = None
    """A disable function to wrap so that a direct call never drives the counter below zero."""

    def version(self) -> str | None:
        """``<name>.__version__`` if the library is imported, else None. Never imports it."""
        version = getattr(sys.modules.get(self.name), "__version__", None)
        return None if version is None else str(version)

    def imported(self) -> bool:
        """Whether the program has imported the library (not necessarily :attr:`module`)."""
        return self.name in sys.modules


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
