"""One library's state, and why, from its facts: the one verdict behind ``status()`` and ``bnb-gc-fix
status``, in the README's words.

The three states, worst first (where several libraries are imported, the worst is the state): a state
says whether code that leaks this way is in use. Asked about this process, it counts the modules
quantized here; asked about a job here (the command), it answers for the modules such a job would
quantize with the library: the same facts, the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from bnb_gc_fix.libraries import BITSANDBYTES, Library
from bnb_gc_fix.lines import counted, possessive

UNPROTECTED = "unprotected"  # modules quantized here with code that leaks this way, the fix not in it
PROTECTED = "protected"  # the fix covers the modules quantized here with code that leaks this way
NOT_AFFECTED = "not affected"  # nothing here is quantized with code that leaks this way, so far
STATES = (UNPROTECTED, PROTECTED, NOT_AFFECTED)


class Hooks(Enum):
    """What a library's hooks do, as its code was read (``bnb_gc_fix.reading``): the package's one word."""

    LEAK = "leak this way"
    DO_NOT_LEAK = "do not leak this way"
    UNREADABLE = "cannot be read"


@dataclass(frozen=True)
class Facts:
    """What is known of one library, for a verdict."""

    library: Library
    version: str | None  # as imported (None: not imported)
    hooks: Hooks | None  # None: its module is not imported
    said: str  # what its register function was read to register
    always_off: bool  # it registers a pair whose off hook torch always calls (upstream's fix)
    fixed: bool  # the fix is in its hooks
    why_not: str  # why the fix is not in them, and what puts it in
    absent: str | None  # why its module is not imported: "no module", "fails", or None (not yet)
    job: bool  # answering for a job here, not for this process's modules
    covered: int = 0  # the modules quantized with it that the fix covers
    at_next_forward: int = 0  # those quantized before the fix went in, covered at their next forward
    leaking: int = 0  # those that run its hooks without the fix (or that the fix cannot cover)


@dataclass(frozen=True)
class LibraryStatus:
    """One library that may register the leaking pair (bitsandbytes, axolotl's copy), judged."""

    name: str
    version: str | None  # None while it is not imported
    hooks: str | None  # what its hooks do: "leak this way", "do not leak this way", "cannot be read"
    fixed: bool  # the fix is in its hooks now
    state: str  # one of STATES
    reason: str  # why, and what to do, in a sentence
    covered: int  # the modules quantized with it that the fix covers
    at_next_forward: int  # those quantized with it before the fix went in: it covers each at its next forward
    leaking: int  # the modules quantized with it that run its hooks without the fix, or that it cannot cover


def judged(facts: Facts) -> LibraryStatus:
    """The library's state and the reason, with what to do, beside its facts."""
    state, reason = _state_and_reason(facts)
    return LibraryStatus(
        name=facts.library.name,
        version=facts.version,
        hooks=None if facts.hooks is None else facts.hooks.value,
        fixed=facts.fixed,
        state=state,
        reason=reason,
        covered=facts.covered,
        at_next_forward=facts.at_next_forward,
        leaking=facts.leaking,
    )


def _state_and_reason(facts: Facts) -> tuple[str, str]:
    if facts.hooks is None:
        return _not_imported(facts)
    if facts.hooks is Hooks.DO_NOT_LEAK and not facts.fixed:
        return NOT_AFFECTED, _not_leaking(facts)
    return _leaking_or_unreadable(facts)


def _not_imported(facts: Facts) -> tuple[str, str]:
    """Where the library's module is not imported: the library itself, or a release that has none."""
    library = facts.library
    if facts.version is None and facts.job:
        return NOT_AFFECTED, f"{library.name} cannot be imported here, so no job here quantizes with it"
    if facts.version is None:
        return NOT_AFFECTED, f"{library.name} is not imported in this process"
    if facts.absent == "no module":
        named = f"{library.name} {facts.version}"
        return NOT_AFFECTED, f"{named} has no {library.module_name}: nothing of this leak"
    if facts.absent == "fails":
        said = (
            f"{library.module_name} could not be imported here, so bnb-gc-fix cannot tell what its hooks do"
        )
        return UNPROTECTED, said
    return NOT_AFFECTED, _nothing_quantized(library)


def _leaking_or_unreadable(facts: Facts) -> tuple[str, str]:
    """Where the library's hooks leak this way, cannot be read, or have the fix (force) in them."""
    named = f"{facts.library.name} {facts.version}"
    if facts.leaking or (facts.job and not facts.fixed):  # a job's modules run what this process's would
        return UNPROTECTED, f"{_running(facts, facts.leaking)}: {facts.why_not}"
    if facts.covered or facts.at_next_forward or facts.job:
        return PROTECTED, _covering(facts)
    if facts.fixed:
        return NOT_AFFECTED, _nothing_quantized(facts.library, f"only such weights leak, in {named}")
    if facts.hooks is Hooks.UNREADABLE:
        would = f"run {possessive(named)} hooks as they are, which bnb-gc-fix cannot read"
    else:
        would = f"leak this way ({possessive(named)} hooks leak)"
    said = f"{_nothing_quantized(facts.library)}; weights quantized that way would {would}"
    return NOT_AFFECTED, f"{said}: {facts.why_not}"


def _quantized(facts: Facts, number: int) -> str:
    """``3 modules quantized here with replace_parameter_4bit``, or a job's."""
    if facts.job:
        return f"the modules a job here quantizes with {facts.library.quantizer_name}"
    return f"{counted(number, 'module')} quantized here with {facts.library.quantizer_name}"


def _running(facts: Facts, number: int) -> str:
    """``3 modules quantized here with replace_parameter_4bit leak this way``, or run hooks not read."""
    one = number == 1 and not facts.job
    if facts.hooks is Hooks.UNREADABLE and not facts.fixed:
        named = possessive(f"{facts.library.name} {facts.version}")
        verb = "runs" if one else "run"
        return f"{_quantized(facts, number)} {verb} {named} hooks as they are"
    verb = "leaks" if one else "leak"
    return f"{_quantized(facts, number)} {verb} this way"


def _covering(facts: Facts) -> str:
    """``the fix covers 3 modules quantized here with replace_parameter_4bit``, and those it covers at their
    next forward (quantized before it was on)."""
    covered, later = facts.covered, facts.at_next_forward
    if not later:
        return f"the fix covers {_quantized(facts, covered)}"
    at_next = "at their next forward" if later > 1 else "at its next forward"
    before = "(quantized before it was on)"
    if not covered:
        return f"the fix covers {_quantized(facts, later)} {at_next} {before}"
    return f"the fix covers {_quantized(facts, covered)}, and {later} more {at_next} {before}"


def _nothing_quantized(library: Library, note: str | None = None) -> str:
    said = f"no module in this process has weights quantized with {library.quantizer_name} now"
    notes = [] if note is None else [note]
    if library is BITSANDBYTES:
        notes.append("BitsAndBytesConfig's Linear4bit layers never use the cache")
    return f"{said} ({'; '.join(notes)})" if notes else said


def _not_leaking(facts: Facts) -> str:
    named = possessive(f"{facts.library.name} {facts.version}")
    if not facts.always_off:  # it registers no hooks that switch the cache
        return f"{facts.said}: nothing of this leak"
    ctrl_c = (
        "A Ctrl-C inside a forward still leaves the cache on: a notebook cell's end reports it; "
        "BNB_GC_FIX=force puts the fix into these hooks too, and the layer's next forward then "
        "switches the cache off"
    )
    return f"{named} hooks switch the cache off even when a forward raises: nothing to fix. {ctrl_c}"
