"""Deciding whether to act: a probe of the real code, with versions read from imported modules.

Nothing here imports torch or bitsandbytes ahead of the user: versions come from ``sys.modules``, and
the probe runs only on a target module (:mod:`bnb_gc_fix.targets`) the user's program has imported.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from types import ModuleType

from packaging.version import InvalidVersion, Version

from bnb_gc_fix.targets import BITSANDBYTES, Target

FIRST_AFFECTED = Version(BITSANDBYTES.first_affected)
MIN_TORCH = Version("2.1")  # Module.register_forward_hook(always_call=True)

PARAMETRIZE = BITSANDBYTES.module


def torch_version() -> str | None:  # never imports torch
    version = getattr(sys.modules.get("torch"), "__version__", None)
    return None if version is None else str(version)


def _release(version: str | None) -> Version | None:
    """The release numbers of a version (0.50.0.dev0 counts as 0.50.0), None when unreadable."""
    try:
        return None if version is None else Version(Version(version).base_version)
    except InvalidVersion:
        return None


def version_in_range(target: Target, version: str | None) -> bool | None:
    """Whether a version of ``target`` falls in its affected range (None: unknown)."""
    release, span = _release(version), (Version(target.first_affected), Version(target.first_fixed))
    return None if release is None else span[0] <= release < span[1]


def torch_too_old(version: str | None) -> bool:
    """Whether a torch version predates forward hooks with ``always_call=True`` (``MIN_TORCH``)."""
    release = _release(version)
    return release is not None and release < MIN_TORCH


def before_parametrize(version: str) -> bool:
    """Whether a bitsandbytes version predates ``bitsandbytes.nn.parametrize`` (its first affected)."""
    release = _release(version)
    return release is not None and release < FIRST_AFFECTED


def no_parametrize(version: str) -> str:
    """Why a bitsandbytes before 0.48.0 needs nothing: the sentence status, CLI and check share."""
    return (
        f"bitsandbytes {version} has no {PARAMETRIZE} (added in {FIRST_AFFECTED}), so it cannot leak this way"
    )


@dataclass(frozen=True)
class Verdict:
    """What the decision found for one imported target module."""

    patch: bool  # wrap its functions
    unexpected: bool  # its internals do not look as expected: nothing may be patched; the user is warned
    affected: bool | None  # its code registers the plain (leaking) pair; None: could not be told
    probe: str  # what the probe saw, in a few words
    reason: str  # a human sentence: what was found
    advice: str = ""  # what the user can do about it, a sentence of its own (or empty)

    @property
    def decision(self) -> str:
        """The finding and what follows from it, then the advice."""
        if self.patch:
            return f"{self.reason}; patched"
        outcome = "nothing patched" if self.unexpected else "nothing to patch"
        return f"{self.reason}; {outcome}{'. ' + self.advice if self.advice else ''}"


def _signature_problem(target: Target, module: ModuleType) -> str | None:
    for name, arity in target.signatures:
        function = getattr(module, name, None)
        if function is None:
            return f"{target.module} has no {name}()"
        if not callable(function):
            return f"{target.module}.{name} is not callable"
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            return f"the signature of {target.module}.{name}() cannot be read"
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is p.empty]
        if len(required) > arity or len(positional) < arity:
            names = ", ".join(p.name for p in positional)
            expected = f"{arity} positional arguments this fix expects"
            return f"{target.module}.{name}({names}) does not take the {expected}"
    return None


def probe(module: ModuleType, target: Target = BITSANDBYTES) -> tuple[bool | None, str]:
    """Call the target's registering function on a throwaway module: ``(affected, what it did)``, affected
    None when unexpected (whatever goes wrong is described, never raised), False for upstream's fix."""
    register = getattr(module, target.register)
    register = getattr(register, "__wrapped__", register)  # judge the library, not our wrapper
    try:
        args = target.probe_args()
        register(*args)
    except Exception as error:  # the probe must never break the user's import
        return None, f"registering hooks on a probe module raised {type(error).__name__}: {error}"
    from bnb_gc_fix.gate import cache_hooks

    throwaway = args[0]
    enables, disables, always_called = cache_hooks(throwaway)
    if len(enables) != 1 or len(disables) != 1:
        return None, (
            f"the probe module got {len(enables)} enable and {len(disables)} disable cache hooks "
            "instead of one of each"
        )
    if always_called:
        return False, "disable hook registered with always_call=True (upstream fix)"
    return True, "plain forward hook pair (skipped when a forward raises)"


def judge(module: ModuleType, force: bool = False, target: Target = BITSANDBYTES) -> Verdict:
    """Decide what to do with an imported target module (``bitsandbytes.nn.parametrize`` by default)."""
    version = target.version()
    by_version = version_in_range(target, version)
    label = f"{target.name} {version}" if version else f"this {target.name}"

    if torch_too_old(torch_version()):
        too_old = f"torch {_release(torch_version())} cannot run forward hooks with always_call=True"
        return Verdict(False, True, by_version, "not run", f"{too_old} (needs torch >= {MIN_TORCH})")
    problem = _signature_problem(target, module)
    if problem is not None:
        return Verdict(False, True, None, "not run", problem)
    affected, seen = probe(module, target)
    if affected is None:
        return Verdict(False, True, None, seen, f"{label} does not look as expected: {seen}")

    span = f"{target.first_affected} <= v < {target.first_fixed}"
    range_text = {
        True: f"is in the affected range {span}",
        False: f"is outside the affected range {span}",
        None: "has an unreadable version",
    }[by_version]
    if force and not affected:
        return Verdict(
            True, False, False, seen, f"{label} has the upstream fix ({seen}), but BNB_GC_FIX=force"
        )
    found = f"the probe found {'a' if affected else 'its'} {seen}"
    if by_version is (not affected):  # the version says the opposite
        reason = f"{label} {range_text}, but {found}, and the probe wins"
    else:
        reason = f"{label} {range_text} and {found}"
    advice = NOT_NEEDED if target is BITSANDBYTES and not affected else ""
    return Verdict(affected, False, affected, seen, reason, advice)


NOT_NEEDED = (
    "bnb-gc-fix is not needed with this bitsandbytes, except to release, at the end of a notebook cell, "
    "the hold a Ctrl-C leaves (BNB_GC_FIX=force adds the gate's Ctrl-C healing everywhere); "
    "pip uninstall bnb-gc-fix removes it"
)
