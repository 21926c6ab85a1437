"""``bnb-gc-fix status``'s answer: what a job in this environment that quantizes with a library gets, read
from the library's code, not from a job.

For each library the command imported: whether its hooks leak this way (as the fix read them when the
library's module was imported; with the fix off, or a module it did not see, read from its code now,
without running any of it), and whether the fix is on and goes into them. ``status()`` in a job stays
about that job's modules.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bnb_gc_fix import activation, releases, status_lines
from bnb_gc_fix.installed import has_module
from bnb_gc_fix.libraries import LIBRARIES, Library
from bnb_gc_fix.lines import possessive
from bnb_gc_fix.status import NOT_AFFECTED, PROTECTED, UNPROTECTED

if TYPE_CHECKING:  # reading imports torch: imported where a library's module is, so torch is too
    from bnb_gc_fix.reading import Reading


@dataclass(frozen=True)
class Answer:
    """What a job here that quantizes with one library gets."""

    name: str
    version: str | None  # None while it is not imported
    affected: bool | None  # whether its hooks leak this way (None: not imported, or not readable)
    fixed: bool  # whether the fix is in them
    state: str  # one of status.STATES
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def answers() -> tuple[Answer, ...]:
    """One answer per library, bitsandbytes first. Imports nothing; never raises."""
    return tuple(_answer(library) for library in LIBRARIES)


def _answer(library: Library) -> Answer:
    version = releases.version_of(library.name)
    module = sys.modules.get(library.module_name)
    if version is None:
        return Answer(library.name, None, None, False, NOT_AFFECTED, _not_imported(library))
    if module is None:
        return _module_not_imported(library, version)
    try:
        what, fixed = _read(library, module)
    except Exception as error:  # an install we cannot read: said, never raised
        said = f"its code could not be read ({type(error).__name__}: {error})"
        return Answer(library.name, version, None, False, UNPROTECTED, said)
    state, reason = _verdict(library, version, what, fixed)
    return Answer(library.name, version, None if what is None else what.leaks, fixed, state, reason)


def _module_not_imported(library: Library, version: str) -> Answer:
    """The library is imported, its module that registers the pair not: a release from before it had one,
    or one that fails to import here (the command says what it raised)."""
    if not has_module(library.module_name):
        return Answer(
            library.name, version, False, False, NOT_AFFECTED, status_lines.no_module(library, version)
        )
    said = f"{library.module_name} could not be imported here, so bnb-gc-fix cannot tell what its hooks do"
    return Answer(library.name, version, None, False, UNPROTECTED, said)


def _not_imported(library: Library) -> str:
    """Why no job here quantizes with the library (the command imported what is installed)."""
    return f"{library.name} cannot be imported here, so no job here quantizes with it"


def _read(library: Library, module: ModuleType) -> tuple[Reading | None, bool]:
    """What the library's hooks were read to do, and whether the fix is in them: as the fix decided for
    the module, else read from its code now."""
    from bnb_gc_fix import code_reading, patch, reading

    fix = activation.fix
    decision = fix.decisions[library.name]
    if fix.turned_on_by is not None and activation.decided_for(library, module):
        return decision.reading, decision.outcome == activation.Outcome.FIXED
    register = patch.own_register(module, library)
    if not callable(register):
        return reading.without_a_register_function(library), False
    return code_reading.read(library, register), False


def _verdict(library: Library, version: str, what: Reading | None, fixed: bool) -> tuple[str, str]:
    """The state and its reason, for a job here that quantizes with the library."""
    job = f"a job here that quantizes with {library.quantizer_name}"
    hooks = f"{possessive(f'{library.name} {version}')} hooks"
    if what is None:
        return _unclear(job, hooks)
    if what.leaks is None:
        return UNPROTECTED, f"bnb-gc-fix cannot read what {hooks} do ({what.said}): {job} runs them as is"
    if not what.leaks:
        return NOT_AFFECTED, f"{hooks} do not leak this way ({what.said})"
    return _leaking(library, job, hooks, fixed)


def _unclear(job: str, hooks: str) -> tuple[str, str]:
    """Where the library's code does not say plainly what its hooks do."""
    unclear = f"their code does not say plainly what {hooks} do"
    if activation.fix.turned_on_by is None:
        return UNPROTECTED, f"{job} runs {hooks} as is: the fix is off ({_switch()}), and {unclear}"
    said = f"{job} has them read at its first quantized module, and the fix goes in there where they leak"
    return PROTECTED, f"{said} ({unclear})"


def _leaking(library: Library, job: str, hooks: str, fixed: bool) -> tuple[str, str]:
    """Where the library's hooks leak this way."""
    if fixed:
        return PROTECTED, f"{job} gets the fix: {hooks} leak this way, and the fix is in them"
    if activation.fix.turned_on_by is None:
        return UNPROTECTED, f"{job} leaks: {hooks} leak this way, and the fix is off ({_switch()})"
    why_not = activation.fix.decisions[library.name].why_not or "bnb-gc-fix did not see its import"
    return UNPROTECTED, f"{job} leaks: {hooks} leak this way, and the fix cannot go in: {why_not}"


def _switch() -> str:
    return status_lines.switched_off_by(activation.fix.switch)
