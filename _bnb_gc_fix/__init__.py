"""bnb-gc-fix's private package: everything that must load without the public package ``bnb_gc_fix``
(importing that one turns the fix on), and the words both share.

PYTEST_DONT_REWRITE: the start-up hook imports this package in every process, before pytest starts;
pytest marks an installed plugin's packages for assertion rewriting, and this marker is its own way of
saying that an already imported one is not to be rewritten (else every run would warn about it).

Its modules import nothing of the public package (the standard library, and pytest for the plugin):

* :mod:`_bnb_gc_fix.startup`: the start-up hook (``bnb_gc_fix.pth``, ``bnb_gc_fix.start``, the runner);
* :mod:`_bnb_gc_fix.cache`: torch's parametrization cache, read and released without importing torch;
* :mod:`_bnb_gc_fix.pytest_plugin`: the leak check for test suites;
* ``runner_path/sitecustomize.py``: what ``bnb-gc-fix run`` puts first on ``PYTHONPATH``.

This module holds the shared words: the switch ``BNB_GC_FIX``, what turned the fix on, the states a
library can be in, and the facts of each library whose pair of hooks the fix replaces. It imports
nothing at all, since neither ``typing`` nor ``dataclasses`` is loaded at start-up.
"""

# No `from __future__ import annotations`: the __future__ module is not loaded at start-up either.
# Annotations that need it are quoted.

#: The public package, which this one never imports at start-up: importing it turns the fix on.
PUBLIC = "bnb_gc_fix"

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
#: The accepted values, as a warning about an unknown one names them.
ACCEPTED = ", ".join("/".join(word or "unset" for word in spellings) for spellings in _SPELLINGS.values())


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
    """Whether ``mode`` puts the package's hooks also where a library's pair is already right
    (bitsandbytes 0.50's always-called pair), for their Ctrl-C healing: what ``force`` means."""
    return mode == FORCE


# --- what turned the fix on (status().via) --------------------------------------------------------
VIA_STARTUP_HOOK = "start-up hook"  # bnb_gc_fix.pth or bnb_gc_fix.start, when a patched module was imported
VIA_RUNNER = "runner"  # bnb-gc-fix run: the package's sitecustomize, likewise
VIA_IMPORT = "import"  # the user's own `import bnb_gc_fix`
VIA_ACTIVATE = "activate()"  # bnb_gc_fix.activate() after the fix was off
VIA_COMMAND = "command"  # a bnb-gc-fix command (status, check), whose own import of the package did it


# --- where a library stands (status().state; bnb_gc_fix.activation.State) --------------------------
PATCHED = "patched"  # our wrappers are its module's functions: protected
UNPATCHED = "unpatched"  # it was patched, and a reload has put its own functions back since
ARMED = "armed"  # patched the moment its module is imported
NOT_INSTALLED = "not installed"  # it (or torch, which it needs) cannot be imported: nothing to patch
NOT_NEEDED = "not needed"  # its code is right (upstream's fix), or it has nothing to patch
# OFF, the switch's word: switched off by BNB_GC_FIX or deactivate(), or not turned on yet
SKIPPED = "skipped"  # its code did not look as expected, or patching failed: nothing patched


# --- the libraries the fix patches ---------------------------------------------------------------
#: The names of the two hook functions of the leaking pair, in bitsandbytes and in every copy of its
#: code (axolotl's): a forward pre-hook that switches torch's parametrization cache on, and a *plain*
#: forward hook (skipped when the forward raises) that switches it off. A pair is recognised by them.
ENABLE_HOOK = "_enable_parametrization_cache"
DISABLE_HOOK = "_disable_parametrization_cache"


class Facts:
    """What is known of one library that registers the leaking pair, before anything of it is imported."""

    __slots__ = ("first_affected", "first_fixed", "module", "name", "register")

    def __init__(
        self, *, name: str, module: str, register: str, first_affected: str, first_fixed: str
    ) -> None:
        self.name = name  # the library (its top-level package), as users know it
        self.module = module  # the module holding its hook functions; patched when it is imported
        self.register = register  # the function that registers the pair on its first argument, a module
        self.first_affected = first_affected  # the first release that registers the plain pair
        self.first_fixed = first_fixed  # the first release whose "off" hook is always called

    @property
    def affected_range(self) -> str:
        return f"{self.first_affected} <= v < {self.first_fixed}"

    @property
    def function_names(self) -> "tuple[str, str, str]":
        """The functions of its module that the fix wraps: the register function and the pair's two."""
        return (self.register, ENABLE_HOOK, DISABLE_HOOK)


BITSANDBYTES = Facts(
    name="bitsandbytes",
    module="bitsandbytes.nn.parametrize",
    register="_register_parametrization_hooks",
    first_affected="0.48.0",  # the first release with bitsandbytes.nn.parametrize at all
    first_fixed="0.50.0",
)

AXOLOTL = Facts(
    name="axolotl",
    module="axolotl.monkeypatch.moe_quant",
    register="replace_parameter_8bit",
    first_affected="0.15.0",
    first_fixed="0.20.0",
)

#: Every library the fix patches; bitsandbytes first (``status().libraries[0]``). The next copy of the
#: pair is one more entry here.
LIBRARIES = (BITSANDBYTES, AXOLOTL)

#: The modules the start-up hook watches: the fix turns on when one of them has been imported.
WATCHED = frozenset(library.module for library in LIBRARIES)
