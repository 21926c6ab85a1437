"""The libraries this package patches, and how to patch each one.

Each registers the leaking pair: a pre-hook switching torch's parametrization cache on, and a *plain*
forward hook, skipped when the forward raises, switching it off. What is known of a library before it
is imported (its module, its hooks' names, its affected range) lives in ``_bnb_gc_fix_vocabulary``,
which the start-up hook reads too; a :class:`Target` adds what patching it needs. To cover the next
look-alike, add its facts to ``_bnb_gc_fix_vocabulary.LIBRARIES`` and its :class:`Target` here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _bnb_gc_fix_vocabulary as vocabulary


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

    facts: vocabulary.Facts
    register: str  # registers the pair on its first argument, a module; wrapped to install the gate
    signatures: tuple[tuple[str, int], ...]  # (function, positional arguments): checked before wrapping
    probe_args: Callable[[], tuple[Any, ...]]  # a probe call's arguments: a throwaway module, ...
    clamp: bool = False  # wrap the disable function so that a direct call never goes below zero

    @property
    def name(self) -> str:
        """The library (its top-level package), as users know it."""
        return self.facts.name

    @property
    def module(self) -> str:
        """The module holding the functions to wrap; patched when it is imported."""
        return self.facts.module

    @property
    def enable_hook(self) -> str:
        return self.facts.enable_hook

    @property
    def disable_hook(self) -> str:
        return self.facts.disable_hook

    @property
    def first_affected(self) -> str:
        """The first release that registers the plain pair. Whether to patch an imported module is the
        probe's decision; the range is what ``status()`` and ``check`` compare it with."""
        return self.facts.first_affected

    @property
    def first_fixed(self) -> str:
        """The first release whose disable hook is always called (upstream's fix)."""
        return self.facts.first_fixed

    @property
    def affected_range(self) -> str:
        return f"{self.first_affected} <= v < {self.first_fixed}"

    def version(self) -> str | None:
        """``<name>.__version__`` if the library is imported (never imports it)."""
        version = getattr(sys.modules.get(self.name), "__version__", None)
        if version is None:
            return None
        return str(version)


BITSANDBYTES = Target(
    facts=vocabulary.BITSANDBYTES,
    register="_register_parametrization_hooks",
    signatures=(
        ("_register_parametrization_hooks", 2),
        (vocabulary.BITSANDBYTES.enable_hook, 2),
        (vocabulary.BITSANDBYTES.disable_hook, 3),
    ),
    probe_args=_probe_bitsandbytes,
    clamp=True,
)

AXOLOTL = Target(
    facts=vocabulary.AXOLOTL,
    register="replace_parameter_8bit",
    signatures=(("replace_parameter_8bit", 2),),
    probe_args=_probe_axolotl,
)

TARGETS: tuple[Target, ...] = (BITSANDBYTES, AXOLOTL)
"""Every patched library; bitsandbytes first (``Status.libraries[0]``)."""
