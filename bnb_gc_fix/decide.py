"""Deciding whether to act: a probe of the real code, with versions read from imported modules.

Nothing here imports torch or a library ahead of the user: versions come from ``sys.modules``, and the
probe runs only on a library's module (``_bnb_gc_fix.LIBRARIES``) the user's program has imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType

from packaging.version import InvalidVersion, Version

from _bnb_gc_fix import BITSANDBYTES, Facts

FIRST_AFFECTED = Version(BITSANDBYTES.first_affected)
MIN_TORCH = Version("2.1")  # Module.register_forward_hook(always_call=True)


def library_version(library: Facts) -> str | None:
    """``<name>.__version__`` if the library is imported (never imports it)."""
    return _imported_version(library.name)


def torch_version() -> str | None:
    """``torch.__version__`` if torch is imported (never imports it)."""
    return _imported_version("torch")


def _imported_version(name: str) -> str | None:
    version = getattr(sys.modules.get(name), "__version__", None)
    if version is None:
        return None
    return str(version)


def _release(version: str | None) -> Version | None:
    """The release numbers of a version (0.50.0.dev0 counts as 0.50.0), None when unreadable."""
    if version is None:
        return None
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return None


def version_in_range(library: Facts, version: str | None) -> bool | None:
    """Whether a version of ``library`` falls in its affected range (None: unknown)."""
    release = _release(version)
    if release is None:
        return None
    return Version(library.first_affected) <= release < Version(library.first_fixed)


def torch_too_old(version: str | None) -> bool:
    """Whether a torch version predates forward hooks with ``always_call=True`` (``MIN_TORCH``)."""
    release = _release(version)
    return release is not None and release < MIN_TORCH


def before_parametrize(version: str) -> bool:
    """Whether a bitsandbytes version predates ``bitsandbytes.nn.parametrize`` (its first affected)."""
    release = _release(version)
    return release is not None and release < FIRST_AFFECTED


def no_parametrize(version: str) -> str:
    """Why a bitsandbytes before its first affected release needs nothing: the sentence status, CLI and
    check share."""
    added = f"added in {FIRST_AFFECTED}"
    return f"bitsandbytes {version} has no {BITSANDBYTES.module} ({added}), so it cannot leak this way"


@dataclass(frozen=True)
class Verdict:
    """What the decision found for one imported library module."""

    should_patch: bool  # wrap its functions
    unexpected: bool  # its internals do not look as expected: nothing may be patched; the user is warned
    affected: bool | None  # its code registers the plain (leaking) pair; None: could not be told
    probe: str  # what the probe saw, in a few words
    reason: str  # a human sentence: what was found
    advice: str = ""  # what the user can do about it, a sentence of its own (or empty)

    @property
    def decision(self) -> str:
        """The finding and what follows from it, then the advice."""
        if self.should_patch:
            return f"{self.reason}; patched"
        outcome = "nothing patched" if self.unexpected else "nothing to patch"
        if self.advice:
            return f"{self.reason}; {outcome}. {self.advice}"
        return f"{self.reason}; {outcome}"


def _missing_function(library: Facts, module: ModuleType) -> str | None:
    """What is missing of the functions the patch wraps, if anything."""
    for name in library.function_names:
        if not callable(getattr(module, name, None)):
            return f"{library.module} has no {name}()"
    return None


def _probe_module() -> object:
    """A throwaway module with a small float weight: a register function takes it and ``"weight"``
    (axolotl's quantizes the weight first, and bitsandbytes' CPU int8 quantizer takes 2-D tensors)."""
    import torch

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(2, 4), requires_grad=False)
    return module


def probe(module: ModuleType, library: Facts) -> tuple[bool | None, str]:
    """Call the library's registering function on a throwaway module: ``(affected, what it did)``.

    ``affected`` is None when the result is unexpected (whatever goes wrong is described, never
    raised) and False for upstream's fix.
    """
    from bnb_gc_fix import patch  # imports torch, which the library's module has imported
    from bnb_gc_fix.hooks import cache_hooks

    register = getattr(module, library.register)
    if patch.is_ours(register):
        register = register.__wrapped__  # judge the library, not our wrapper
    try:
        probed = _probe_module()
        register(probed, "weight")
    except Exception as error:  # the probe must never break the user's import
        return None, f"registering hooks on a probe module raised {type(error).__name__}: {error}"
    found = cache_hooks(probed)  # type: ignore[arg-type]
    if len(found.enable_keys) != 1 or len(found.disable_keys) != 1:
        return None, (
            f"the probe module got {len(found.enable_keys)} enable and {len(found.disable_keys)} disable "
            "cache hooks instead of one of each"
        )
    if found.always_called:
        return False, "disable hook registered with always_call=True (upstream fix)"
    return True, "plain forward hook pair (skipped when a forward raises)"


def _range_text(library: Facts, by_version: bool | None) -> str:
    """Where the version lies against the library's affected range, as the end of a sentence."""
    if by_version is None:
        return "has an unreadable version"
    where = "in" if by_version else "outside"
    return f"is {where} the affected range {library.affected_range}"


def _skipped(reason: str, affected: bool | None, probe: str = "not run") -> Verdict:
    """Nothing may be patched: the library does not look as expected (the user is warned)."""
    return Verdict(should_patch=False, unexpected=True, affected=affected, probe=probe, reason=reason)


def judge(module: ModuleType, force: bool, library: Facts) -> Verdict:
    """Decide what to do with an imported library module: check the torch and the functions it needs,
    then probe the library's own code."""
    version = library_version(library)
    by_version = version_in_range(library, version)
    label = f"{library.name} {version}" if version else f"this {library.name}"

    torch = torch_version()
    if torch_too_old(torch):
        too_old = f"torch {_release(torch)} cannot run forward hooks with always_call=True"
        return _skipped(f"{too_old} (needs torch >= {MIN_TORCH})", affected=by_version)
    missing = _missing_function(library, module)
    if missing is not None:
        return _skipped(missing, affected=None)

    affected, seen = probe(module, library)
    if affected is None:
        return _skipped(f"{label} does not look as expected: {seen}", affected=None, probe=seen)
    if force and not affected:
        return Verdict(
            should_patch=True,
            unexpected=False,
            affected=False,
            probe=seen,
            reason=f"{label} has the upstream fix ({seen}), but BNB_GC_FIX=force",
        )
    found = f"the probe found {'a' if affected else 'its'} {seen}"
    version_disagrees = by_version is not None and by_version != affected
    if version_disagrees:
        reason = f"{label} {_range_text(library, by_version)}, but {found}, and the probe wins"
    else:
        reason = f"{label} {_range_text(library, by_version)} and {found}"
    advice = UPSTREAM_FIXED_ADVICE if library is BITSANDBYTES and not affected else ""
    return Verdict(
        should_patch=affected, unexpected=False, affected=affected, probe=seen, reason=reason, advice=advice
    )


UPSTREAM_FIXED_ADVICE = (
    "bnb-gc-fix is not needed with this bitsandbytes, except for what a Ctrl-C inside a forward leaves "
    "switched on: pointed out at the end of a notebook cell, released with BNB_GC_FIX=force (the "
    "package's hooks then take bitsandbytes' place) or bnb_gc_fix.reset(); pip uninstall bnb-gc-fix "
    "removes it"
)
