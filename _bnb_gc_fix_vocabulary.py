"""The words the start-up hook and the package share, in one place: the switch ``BNB_GC_FIX``, what
turned the fix on, and the facts of each library the fix patches.

The start-up hook reads this module in every Python process, before it may import the package, so it
imports nothing at all: no ``typing``, no ``dataclasses`` (neither is loaded at start-up). The package
builds its richer records (:mod:`bnb_gc_fix.targets`) from the facts here.
"""

# No `from __future__ import annotations`: the __future__ module is not loaded at start-up either.
# Annotations that need it are quoted.

# --- the switch ----------------------------------------------------------------------------------
VARIABLE = "BNB_GC_FIX"
AUTO = "auto"
ON = "on"
OFF = "off"
FORCE = "force"

_SPELLINGS = {
    AUTO: ("", "auto"),
    ON: ("1", "on", "true", "yes"),
    OFF: ("0", "off", "false", "no"),
    FORCE: ("force",),
}
_MODES = {spelling: mode for mode, spellings in _SPELLINGS.items() for spelling in spellings}
ACCEPTED = "auto (or unset), 1/on/true/yes, 0/off/false/no, force"


def parse(raw: "str | None") -> "tuple[str, bool]":
    """The mode a raw ``BNB_GC_FIX`` value asks for, and whether the value was recognised.

    The value is trimmed and read case-insensitively; None (unset) means auto. An unknown value also
    means auto, and the caller says so: the start-up hook stays silent, the package warns once.
    """
    spelling = "" if raw is None else raw.strip().lower()
    mode = _MODES.get(spelling)
    if mode is None:
        return AUTO, False
    return mode, True


def forces(mode: str) -> bool:
    """Whether ``mode`` gates pairs that are already right (bitsandbytes 0.50's always-called pair),
    for the gate's Ctrl-C healing. This is what ``force`` means, and the one place that says so."""
    return mode == FORCE


# --- what turned the fix on (status().via) --------------------------------------------------------
VIA_STARTUP_HOOK = "start-up hook"  # bnb_gc_fix.pth or bnb_gc_fix.start, at the first import of bitsandbytes
VIA_RUNNER = "runner"  # bnb-gc-fix run: the package's sitecustomize, at the first import of bitsandbytes
VIA_IMPORT = "import"  # the user's own `import bnb_gc_fix`
VIA_ACTIVATE = "activate()"  # bnb_gc_fix.activate() after the fix was off
VIA_COMMAND = "command"  # a bnb-gc-fix command (status, check), whose own import of the package did it


# --- the libraries the fix patches ---------------------------------------------------------------
class Facts:
    """What is known of one library that registers the leaking pair of hooks, before anything of it is
    imported: a pre-hook switching torch's parametrization cache on, and a *plain* forward hook
    (skipped when the forward raises) switching it off."""

    __slots__ = ("disable_hook", "enable_hook", "first_affected", "first_fixed", "module", "name")

    def __init__(
        self,
        *,
        name: str,
        module: str,
        enable_hook: str,
        disable_hook: str,
        first_affected: str,
        first_fixed: str,
    ) -> None:
        self.name = name  # the library (its top-level package), as users know it
        self.module = module  # the module whose functions are wrapped; patched when it is imported
        self.enable_hook = enable_hook  # the name of its pre-hook function (the "on")
        self.disable_hook = disable_hook  # the name of its forward hook function (the "off")
        self.first_affected = first_affected  # the first release that registers the plain pair
        self.first_fixed = first_fixed  # the first release whose "off" hook is always called


BITSANDBYTES = Facts(
    name="bitsandbytes",
    module="bitsandbytes.nn.parametrize",
    enable_hook="_enable_parametrization_cache",
    disable_hook="_disable_parametrization_cache",
    first_affected="0.48.0",  # the first release with bitsandbytes.nn.parametrize at all
    first_fixed="0.50.0",
)

AXOLOTL = Facts(
    name="axolotl",
    module="axolotl.monkeypatch.moe_quant",
    enable_hook="_enable_parametrization_cache",
    disable_hook="_disable_parametrization_cache",
    first_affected="0.15.0",
    first_fixed="0.20.0",
)

LIBRARIES = (BITSANDBYTES, AXOLOTL)  # bitsandbytes first

#: bitsandbytes' top-level import: the start-up hook activates the fix when its code is about to run.
TRIGGER = BITSANDBYTES.name
#: Every module whose loader a watcher wraps: the trigger, and each patched library's module.
WATCHED = frozenset((TRIGGER, *(library.module for library in LIBRARIES)))
