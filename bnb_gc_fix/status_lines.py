"""What ``status()`` says, in the README's words: the phrases each library's reason is made of, and how a
:class:`bnb_gc_fix.status.Status` is printed (its state, fix and cache lines, each at most 100
characters: ``bnb_gc_fix.lines``). The facts, and the states they make, are ``status.py``'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

import _bnb_gc_fix as startup
from bnb_gc_fix import activation
from bnb_gc_fix.libraries import BITSANDBYTES, Library
from bnb_gc_fix.lines import counted, labelled, possessive

if TYPE_CHECKING:
    from bnb_gc_fix.status import LibraryStatus, Status

#: Advice that holds wherever it is given: reset() inside an open ``P.cached()`` block leaves the counter
#: at -1 when the block ends, and the cache on for good.
RESET_ADVICE = "bnb_gc_fix.reset() switches it off, once no forward runs and no P.cached() block is open"


# --- the phrases a library's reason is made of ---------------------------------------------------------
def switched_off_by(switch: str | None) -> str:
    """``BNB_GC_FIX='0'; unset it to turn the fix on``."""
    return f"{startup.VARIABLE}={switch!r}; unset it to turn the fix on"


def no_module(library: Library, version: str) -> str:
    """A release from before the library had the module that registers the pair."""
    return f"{library.name} {version} has no {library.module_name}: nothing of this leak"


def nothing_quantized(library: Library, leaking_release: str | None = None) -> str:
    """No module quantized that way; ``leaking_release``: the release whose hooks were read to leak."""
    said = f"no module in this process has weights quantized with {library.quantizer_name} now"
    notes = []
    if leaking_release is not None:
        notes.append(f"only such weights leak, in {library.name} {leaking_release}")
    if library is BITSANDBYTES:
        notes.append("BitsAndBytesConfig's Linear4bit layers never use the cache")
    return f"{said} ({'; '.join(notes)})" if notes else said


def quantized_here(library: Library, number: int) -> str:
    """``3 modules quantized here with replace_parameter_4bit``."""
    return f"{counted(number, 'module')} quantized here with {library.quantizer_name}"


def leak_this_way(library: Library, number: int) -> str:
    """``3 modules quantized here with replace_parameter_4bit leak this way``."""
    verb = "leaks" if number == 1 else "leak"
    return f"{quantized_here(library, number)} {verb} this way"


def covering(library: Library, covered: int, at_next_forward: int) -> str:
    """``the fix covers 3 modules quantized here with replace_parameter_4bit``, and those it covers at their
    next forward (quantized before it was on)."""
    if not at_next_forward:
        return f"the fix covers {quantized_here(library, covered)}"
    later = "at their next forward" if at_next_forward > 1 else "at its next forward"
    before = "(quantized before it was on)"
    if not covered:
        return f"the fix covers {quantized_here(library, at_next_forward)} {later} {before}"
    return f"the fix covers {quantized_here(library, covered)}, and {at_next_forward} more {later} {before}"


def _leaking_through(status: Status, library: LibraryStatus) -> str:
    """What leaks the library's modules run: its own hooks, or, with the fix in them, modules the fix
    cannot cover."""
    if library.fixed:
        modules = counted(library.leaking, "module")
        return (
            f"{modules} quantized here with {library.name} that the fix cannot cover (another tool's "
            "function in front of their pre-hooks)"
        )
    why = "the fix is off" if status.turned_on_by is None else "the fix is not in them"
    return f"{possessive(library.name)} own hooks ({why})"


# --- a Status, printed ---------------------------------------------------------------------------------
def lines(status: Status, who_turned_it_on: bool = True) -> list[str]:
    """What ``print(status())`` shows: state, fix, cache, and another library only where one is
    imported beside the one the state comes from. ``who_turned_it_on=False``: ``bnb-gc-fix``'s own
    process, where the command itself turned the fix on."""
    lines = [state_line(status), fix_line(status, who_turned_it_on), cache_line(status)]
    others = [lib for lib in status.libraries if lib.version is not None and lib is not status.worst]
    lines += [labelled(f"{lib.name} {lib.version}", f"{lib.state}: {lib.reason}") for lib in others]
    return lines


def state_line(status: Status) -> str:
    return labelled("state", f"{status.state}: {status.reason}")


def fix_line(status: Status, who_turned_it_on: bool = True) -> str:
    switch = f"{startup.VARIABLE} unset" if status.switch is None else f"{startup.VARIABLE}={status.switch!r}"
    if status.turned_on_by is None:
        return labelled("fix", f"off ({switch})")
    not_needed_by = _not_needed_by(status)
    if not_needed_by:
        text = f"not needed here: the hooks of {not_needed_by} do not leak this way ({switch})"
        return labelled("fix", text)
    if who_turned_it_on:
        text = f"on, turned on by {status.turned_on_by} ({switch})"
    else:
        text = f"on ({switch})"
    said_the_hook = who_turned_it_on and status.turned_on_by == activation.STARTUP_HOOK
    return labelled("fix", text + _elsewhere_text(status, said_the_hook))


def _not_needed_by(status: Status) -> str:
    """The libraries imported here, if every one of them was read not to leak and the fix is in none of
    them (else "")."""
    imported = [library for library in status.libraries if library.version is not None]
    if not imported or any(library.affected is not False or library.fixed for library in imported):
        return ""
    return " and ".join(f"{library.name} {library.version}" for library in imported)


def _elsewhere_text(status: Status, said_the_hook: bool) -> str:
    """What the start-up hook means for this environment's other processes, where that is news."""
    if not status.start_up_hook_ran:
        return (
            "; the start-up hook did not run here, so a process that never imports bnb_gc_fix gets no "
            "fix (docs/reference.md: where the start-up hook cannot run)"
        )
    if said_the_hook:
        return ""
    if BITSANDBYTES.module_name in status.watching:
        waits = f"it waits for {BITSANDBYTES.module_name}, not imported yet"
        return (
            f"; the start-up hook ran here too ({waits}), and turns the fix on at that import in "
            "processes that never import bnb_gc_fix"
        )
    return "; processes here that never import bnb_gc_fix get it too (the start-up hook runs in them)"


def cache_line(status: Status) -> str:
    if status.counter is None:
        return labelled("cache", "not in use (torch's parametrize module is not imported)")
    switched = "on" if status.counter else "off"
    text = f"{switched}, counter {status.counter}, {status.cache_bytes} bytes"
    if status.counter - status.from_the_fix > 0:
        text += f"; {who_keeps_it_on(status)}"
    return labelled("cache", text)


def who_keeps_it_on(status: Status) -> str:
    """What keeps the cache on beyond the fix's own forwards: modules that leak this way first, else
    what may (a Ctrl-C in hooks the fix is not in and that do not need it, an open P.cached() block,
    a forward on another thread), and when reset() is safe."""
    leaking = [library for library in status.libraries if library.leaking]
    if leaking:
        return "left on by " + " and ".join(_leaking_through(status, library) for library in leaking)
    causes = [
        f"a Ctrl-C inside a forward of {possessive(f'{library.name} {library.version}')} own hooks"
        for library in status.libraries
        if library.affected is False and not library.fixed
    ]
    causes += [
        "a P.cached() block still open",
        "a forward running on another thread or begun before the fix was on",
    ]
    said = f"bnb-gc-fix cannot tell what else switched it on ({'; '.join(causes)}). If nothing keeps it "
    said += f"on on purpose, {RESET_ADVICE}"
    if status.from_the_fix:
        said = f"the fix's own forwards account for {status.from_the_fix} of it; {said}"
    return said
