"""Tomorrow's bitsandbytes: the fix decided by what a release's code says, never by its version or the
names of its hooks, and never by running any of it (issues 47 and 54). Each release here is built by the
test from a real one: the installed bitsandbytes' own ``nn/parametrize.py``, changed as a later release
(or a development build) might change it, is what ``bitsandbytes.nn.parametrize`` imports (a folder first
on ``bitsandbytes.nn.__path__``), and ``bitsandbytes.__version__`` says what that release would say;
bitsandbytes 0.50.2's code (downloaded) for the releases built on the fixed line. Each runs beside its
control, the same release with the fix off: where the control runs, the fixed run runs too, ends no worse,
and calls no more of the library than the control does.

The register function's code is read at import. Where it registers the known pair plainly, the fix goes
in where the pair leaks; where it registers no forward hook, there is nothing to fix. Anywhere else (a
helper that registers, ``functools.partial``, other arguments, hooks of another body, no register function)
its hooks cannot be read: the fix stays out, one warning says so, and a module quantized through it is
``unprotected``. The real releases: 0.48.0 to 0.49.2, and bitsandbytes' main before its fix (which said
0.50.0.dev0), ship the installed release's file; 0.50.0, 0.50.1 and main after its fix ship 0.50.2's.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from conftest import AFFECTED, BITSANDBYTES, environment, pip_target, run_code, unwrapped

pytestmark = [
    pytest.mark.usefixtures("startup_hook_installed"),
    pytest.mark.skipif(not AFFECTED, reason="the releases are built from an affected bitsandbytes' code"),
]

REGISTER = "_register_parametrization_hooks"
ENABLE = "_enable_parametrization_cache"
DISABLE = "_disable_parametrization_cache"
PAIR = f"    module.register_forward_pre_hook({ENABLE})\n    module.register_forward_hook({DISABLE})\n"
HEADER = f"def {REGISTER}(module: nn.Module, param_name: str):\n"
ENABLE_DEF = f"def {ENABLE}(module: nn.Module, inputs: tuple[Any, ...]):\n    P._cache_enabled += 1\n"
DISABLE_DEF = (
    f"def {DISABLE}(module: nn.Module, inputs: tuple[Any, ...], output: Any):\n"
    "    P._cache_enabled -= 1\n"
    "    if not P._cache_enabled:\n"
    "        P._cache = {}\n"
)
RENAMED = {REGISTER: "_add_parametrization_cache_hooks", ENABLE: "_cache_on", DISABLE: "_cache_off"}
# A helper that registers the hooks it is given (issue 54's finding 1).
ADD = (
    "def _add(module, pre, off):\n"
    "    module.register_forward_pre_hook(pre)\n"
    "    module.register_forward_hook(off)\n\n\n"
)
THROUGH_ADD = f"    _add(module, {ENABLE}, {DISABLE})\n"

# What each release built from the installed (leaking) code changes in it.
FROM_THE_INSTALLED = {
    # bitsandbytes' own main between the 0.49.2 tag and its fix said 0.50.0.dev0, with the plain pair.
    "a development build of the fixed line": ("0.50.0.dev0", {}),
    "a register function that reads the module first": (
        BITSANDBYTES,
        {
            HEADER: HEADER
            + "    module.parametrizations[param_name]  # only a module quantized already has it\n"
        },
    ),
    "a register function that registers nothing": (BITSANDBYTES, {PAIR: ""}),
    # Issue 51: an always-called pair of plain functions.
    "the installed pair, always called": (
        BITSANDBYTES,
        {
            f"_forward_hook({DISABLE})\n": f"_forward_hook({DISABLE}, always_call=True)\n",
        },
    ),
    # axolotl 0.20's and 0.21's shape: the pair registered, always called, by a function of the library's
    # own that takes the module alone.
    "the installed pair, always called, registered by a helper": (
        BITSANDBYTES,
        {
            HEADER: (
                "def _register_cache_hooks(module):\n"
                f"    module.register_forward_pre_hook({ENABLE})\n"
                f"    module.register_forward_hook({DISABLE}, always_call=True)\n\n\n" + HEADER
            ),
            PAIR: "    _register_cache_hooks(module)\n",
        },
    ),
    # --- what its code does not say plainly: each the control's counters --------------------------------
    "a helper given the hooks": (BITSANDBYTES, {HEADER: ADD + HEADER, PAIR: THROUGH_ADD}),
    # Issue 54's finding 1: a leaking pair that binds P=P as a default, registered through a helper; the
    # hooks count their calls through a default as well.
    "a pair binding P as a default, through a helper": (
        "0.51.0",
        {
            DISABLE_DEF: (
                "CALLS = []\n\n\n"
                f"def {DISABLE}(module, inputs, output, P=P, calls=CALLS):\n"
                '    calls.append("off")\n'
                "    P._cache_enabled -= 1\n"
                "    if not P._cache_enabled:\n"
                "        P._cache = {}\n"
            ),
            ENABLE_DEF: (
                f"def {ENABLE}(module, inputs, P=P, calls=CALLS):\n"
                '    calls.append("on")\n'
                "    P._cache_enabled += 1\n"
            ),
            HEADER: ADD + HEADER,
            PAIR: THROUGH_ADD,
        },
    ),
    "hook functions wrapped in functools.partial": (
        BITSANDBYTES,
        {
            PAIR: (
                f"    module.register_forward_pre_hook(partial({ENABLE}))\n"
                f"    module.register_forward_hook(partial({DISABLE}))\n"
            )
        },
    ),
    "functools.partial hooks, always called": (
        BITSANDBYTES,
        {
            PAIR: (
                f"    module.register_forward_pre_hook(partial({ENABLE}))\n"
                f"    module.register_forward_hook(partial({DISABLE}), always_call=True)\n"
            )
        },
    ),
    "the pre-hook registered with prepend=True": (
        BITSANDBYTES,
        {f"_pre_hook({ENABLE})\n": f"_pre_hook({ENABLE}, prepend=True)\n"},
    ),
    "the off hook registered with another argument": (
        BITSANDBYTES,
        {f"_forward_hook({DISABLE})\n": f"_forward_hook({DISABLE}, prepend=False)\n"},
    ),
    "plain functions that switch the cache by two": (
        BITSANDBYTES,
        {
            "P._cache_enabled += 1\n": "P._cache_enabled += 2\n",
            "P._cache_enabled -= 1\n": "P._cache_enabled -= 2\n",
        },
    ),
    "plain functions that never switch the cache": (
        BITSANDBYTES,
        {
            ENABLE_DEF: f"def {ENABLE}(module, inputs):\n    return None\n",
            DISABLE_DEF: f"def {DISABLE}(module, inputs, output):\n    return None\n",
        },
    ),
    "builtins as hooks": (
        BITSANDBYTES,
        {
            PAIR: (
                "    builtin = Exception().__init__  # implemented in C: takes any arguments, returns None\n"
                "    module.register_forward_pre_hook(builtin)\n"
                "    module.register_forward_hook(builtin)\n"
            )
        },
    ),
    "the leaking pair, renamed": ("0.51.0", RENAMED),
    "registering methods named in strings": (
        BITSANDBYTES,
        {
            PAIR: (
                f"    for method, hook in (('register_forward_pre_hook', {ENABLE}),"
                f" ('register_forward_hook', {DISABLE})):\n"
                "        getattr(module, method)(hook)\n"
            )
        },
    ),
    "a helper defined inside the register function": (
        BITSANDBYTES,
        {
            PAIR: (
                "    def add():\n"
                f"        module.register_forward_pre_hook({ENABLE})\n"
                f"        module.register_forward_hook({DISABLE})\n"
                "    add()\n"
            )
        },
    ),
}
#: The releases whose hooks cannot be read, each with its control's counters after three steps.
UNREADABLE = {
    "a helper given the hooks": [2, 4, 6],
    "a pair binding P as a default, through a helper": [2, 4, 6],
    "hook functions wrapped in functools.partial": [2, 4, 6],
    "functools.partial hooks, always called": [0, 0, 0],
    "the pre-hook registered with prepend=True": [2, 4, 6],
    "the off hook registered with another argument": [2, 4, 6],
    "plain functions that switch the cache by two": [4, 8, 12],
    "plain functions that never switch the cache": [0, 0, 0],
    "builtins as hooks": [0, 0, 0],
    "the leaking pair, renamed": [2, 4, 6],
    "registering methods named in strings": [2, 4, 6],
    "a helper defined inside the register function": [2, 4, 6],
}
# ...and from bitsandbytes 0.50.2's (fixed) code.
FROM_0_50_2 = {
    "a development build after the fix": ("0.50.0.dev0", {}),  # bitsandbytes' main after its fix
    "the fixed pair, renamed": ("0.51.0", RENAMED),
    "the fixed pair, an old version number": ("0.49.2", {}),
}
#: The hook functions' names, in every release here.
HOOK_NAMES = {ENABLE, DISABLE, "_cache_on", "_cache_off"}

# Issue 51: importing bitsandbytes' 4-bit module runs none of its functions but its module's own code, and
# makes no module of the fix's own; the fix is decided all the same, from the code (8dd19c6 called its
# register function on a throwaway module, then copies of its hooks on a stand-in). Every call of a
# function from the library's file is recorded while the module is imported, and every read of every
# object Python's collector tracks (the modules quantized before a late import are found that way).
AT_IMPORT = """
import gc, torch
def modules():
    return sum(isinstance(each, torch.nn.Module) for each in gc.get_objects())
alive = modules()
calls = []
def record(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_filename.endswith("parametrize.py") and "bitsandbytes" in code.co_filename:
        calls.append(code.co_name)
walks = []
read_every_object = gc.get_objects
gc.get_objects = lambda *args: walks.append(1) or read_every_object(*args)
sys.setprofile(record)
import bitsandbytes.nn.parametrize
sys.setprofile(None)
gc.get_objects = read_every_object
made = modules() - alive
fix = sys.modules.get("bnb_gc_fix")
fixed = fix.status().library("bitsandbytes").fixed if fix is not None else None
print(json.dumps({"calls": calls, "modules": made, "fixed": fixed, "walks": len(walks)}))
"""


def test_importing_the_library_runs_nothing_of_it_and_makes_no_module() -> None:
    fixed = run_code(AT_IMPORT, prelude="scenarios", switch=None).last_json
    control = run_code(AT_IMPORT, prelude="scenarios", switch="0").last_json
    assert control["calls"][0] == "<module>" and control["modules"] == 0  # its module's own code
    assert fixed["calls"] == control["calls"] and fixed["modules"] == 0  # nothing more of it ran
    assert fixed["fixed"] is True and control["fixed"] is None  # the fix decided from its code alone
    assert fixed["walks"] == control["walks"] == 0  # and read no object: nothing was quantized before


# A user's script on that release: import it, quantize, three checkpointed steps, and what the package
# said before the module was quantized, after the steps, and as `bnb-gc-fix status`. Every call of a
# function of the release's file is recorded while the module is imported and while it quantizes.
RELEASE = """
import contextlib, io, warnings
import bitsandbytes, bitsandbytes.nn
bitsandbytes.__version__ = sys.argv[2]
bitsandbytes.nn.__path__.insert(0, sys.argv[1])  # its nn/parametrize.py is the release's
calls = {"import": [], "quantize": []}

def recording(phase):
    def record(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(sys.argv[1]):
            calls[phase].append(frame.f_code.co_name)
    return record

def said(fix):
    status = fix and fix.status()
    return status and {"state": status.state, "lines": status.lines()}

def counted(parametrize):  # the calls the release's hooks counted through a default, if they count
    return len(parametrize.CALLS) if hasattr(parametrize, "CALLS") else None

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sys.setprofile(recording("import"))
    from bitsandbytes.nn import parametrize
    sys.setprofile(None)
    fix = sys.modules.get("bnb_gc_fix")
    before = said(fix)
    import quantized
    sys.setprofile(recording("quantize"))
    model = quantized.make(params=2)
    sys.setprofile(None)
    counted_quantizing = counted(parametrize)
    counters = quantized.checkpointed_counters(model, steps=3)
    after = said(fix)
    command = None
    if fix is not None:
        from bnb_gc_fix.cli import main
        with contextlib.redirect_stdout(io.StringIO()) as out:
            main(["status"])
        command = out.getvalue()
assert parametrize.__file__.startswith(sys.argv[1]), parametrize.__file__
ours = [w for w in caught if fix is not None and isinstance(w.message, fix.BnbGcFixWarning)]
print(json.dumps({
    "counters": counters,
    "calls": calls,
    "counted": [counted_quantizing, counted(parametrize)],
    "warnings": [str(w.message) for w in ours],
    "fixed": fix and fix.status().library("bitsandbytes").fixed,
    "before": before,
    "after": after,
    "command": command,
}))
"""


def _release(folder: Path, code: Path, changes: dict[str, str]) -> Path:
    """A folder holding ``parametrize.py``: ``code``'s, with each of ``changes`` made (each must apply)."""
    source = code.read_text()
    for old, new in changes.items():
        assert old in source, f"{old!r} is not in {code}: the installed release changed"
        source = source.replace(old, new)
    folder.mkdir(parents=True)
    (folder / "parametrize.py").write_text(source)
    return folder


def _installed_code() -> Path:
    return Path(str(metadata.distribution("bitsandbytes").locate_file("bitsandbytes/nn/parametrize.py")))


def _run(folder: Path, version: str, switch: str | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    fresh = "bitsandbytes 0.50.2 on PYTHONPATH: the warm parent imported the installed release"
    if env is not None:
        env = {k: v for k, v in env.items() if k != "BNB_GC_FIX"}
        env.update({} if switch is None else {"BNB_GC_FIX": switch})
    run = run_code(
        RELEASE,
        str(folder),
        version,
        prelude="scenarios",
        switch=switch,
        env=env,
        fresh=fresh if env else None,
    )
    facts: dict[str, Any] = run.last_json
    for when in ("before", "after"):
        said = facts.pop(when) or {"state": None, "lines": []}
        facts["state" if when == "after" else "state before"] = said["state"]
        facts["said" if when == "after" else "said before"] = unwrapped("\n".join(said["lines"]))
    facts["command"] = unwrapped(facts["command"] or "")
    facts["warnings"] = [unwrapped(warning) for warning in facts["warnings"]]
    return facts


@pytest.fixture(scope="module")
def installed_releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    made = {}
    for name, (version, changes) in FROM_THE_INSTALLED.items():
        folder = tmp_path_factory.mktemp("release") / re.sub(r"\W+", "-", name)
        made[name] = (_release(folder, _installed_code(), changes), version)
    return made


def _fixed_and_control(
    releases: dict[str, tuple[Path, str]], name: str, switch: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    folder, version = releases[name]
    fixed, control = _run(folder, version, switch), _run(folder, version, "0")
    assert control["warnings"] == [] and control["state"] is None  # the package never imported
    assert all(f <= c for f, c in zip(fixed["counters"], control["counters"])), (fixed, control)
    # Nothing of the library ran but what the control runs: its module's code, then its quantizer.
    assert fixed["calls"] == control["calls"], (fixed["calls"], control["calls"])
    assert not HOOK_NAMES & {*fixed["calls"]["import"], *fixed["calls"]["quantize"]}, fixed["calls"]
    return fixed, control


def test_a_development_build_of_the_fixed_line_carrying_the_leaking_pair_gets_the_fix(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "a development build of the fixed line")
    assert control["counters"] == [2, 4, 6]  # two plain pairs, each left on by every recompute
    assert fixed["counters"] == [0, 0, 0] and fixed["warnings"] == [] and fixed["fixed"] is True
    assert fixed["state"] == "protected"
    # The release number says it is of the fixed line; what its code does decides, and nothing compares.
    assert (
        "state: protected: the fix covers 1 module quantized here with replace_parameter_4bit fix:"
        in fixed["said"]
    )
    assert "fix: in bitsandbytes 0.50.0.dev0's hooks (BNB_GC_FIX unset)" in fixed["said"]
    assert "state: protected: " in fixed["command"]


def test_a_register_function_that_reads_the_module_first_is_read_from_its_code(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    # 8dd19c6 called it on a throwaway module, where it raised, and read the first real one instead.
    fixed, control = _fixed_and_control(installed_releases, "a register function that reads the module first")
    assert control["counters"] == [2, 4, 6]
    assert fixed["counters"] == [0, 0, 0] and fixed["warnings"] == [] and fixed["state"] == "protected"


def test_a_register_function_that_registers_nothing_needs_no_fix_and_says_so(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "a register function that registers nothing")
    assert control["counters"] == fixed["counters"] == [0, 0, 0]
    assert fixed["warnings"] == [] and fixed["fixed"] is False
    assert fixed["state before"] == fixed["state"] == "not affected"
    said = (
        f"state: not affected: bitsandbytes.nn.parametrize.{REGISTER}() registers no forward hooks: nothing"
    )
    assert said in fixed["said"]
    assert (
        f"fix: not needed here: the hooks of bitsandbytes {BITSANDBYTES} do not leak this way"
        in fixed["said"]
    )
    assert "state: not affected: " in fixed["command"]


def test_an_always_called_pair_of_plain_functions_is_read_as_not_leaking(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "the installed pair, always called")
    assert control["counters"] == fixed["counters"] == [0, 0, 0]  # upstream's fix, without its clamp
    assert fixed["warnings"] == [] and fixed["state"] == "not affected"  # read as it is: nothing to fix
    assert (
        f"bitsandbytes {BITSANDBYTES}'s hooks switch the cache off even when a forward raises"
        in fixed["said"]
    )


def test_an_always_called_pair_registered_by_a_helper_of_the_librarys_own_is_read_as_not_leaking(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    # axolotl 0.20's and 0.21's shape (test_axolotl.py runs the real ones where Python admits them): d75b8f8
    # read its pair as always called (not affected; force put the fix in).
    name = "the installed pair, always called, registered by a helper"
    fixed, control = _fixed_and_control(installed_releases, name)
    assert control["counters"] == fixed["counters"] == [0, 0, 0]
    assert fixed["warnings"] == [] and fixed["state"] == "not affected"
    assert (
        f"bitsandbytes {BITSANDBYTES}'s hooks switch the cache off even when a forward raises"
        in fixed["said"]
    )
    folder, version = installed_releases[name]
    forced = _run(folder, version, "force")
    assert forced["warnings"] == [] and forced["fixed"] is True and forced["state"] == "protected"
    assert forced["counters"] == [0, 0, 0]


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_hooks_whose_code_does_not_say_plainly_what_they_do_are_unreadable_and_the_fix_stays_out(
    installed_releases: dict[str, tuple[Path, str]], name: str
) -> None:
    fixed, control = _fixed_and_control(installed_releases, name)
    assert control["counters"] == fixed["counters"] == UNREADABLE[name]  # the library's own hooks ran
    _, version = installed_releases[name]
    named = f"bitsandbytes {version}"
    # One warning, naming the release and saying that its hooks cannot be read.
    [warning] = fixed["warnings"]
    assert warning.startswith(f"bnb-gc-fix is not in {named}: bnb-gc-fix cannot read its hooks ("), warning
    assert warning.endswith("; `bnb-gc-fix check` shows whether they leak."), warning
    assert fixed["fixed"] is False
    # Before a module is quantized through it: not affected, with the hooks that cannot be read named.
    assert fixed["state before"] == "not affected"
    would = f"weights quantized that way would run {named}'s hooks as they are, which bnb-gc-fix cannot read"
    assert would in fixed["said before"]
    # After: the module quantized through it is unprotected, and the command says so of a job.
    assert fixed["state"] == "unprotected", fixed["said"]
    runs = f"replace_parameter_4bit runs {named}'s hooks as they are: the fix could not be put in: "
    assert (
        f"state: unprotected: 1 module quantized here with {runs}bnb-gc-fix cannot read its hooks ("
        in (fixed["said"])
    )
    assert f"fix: not in {named}'s hooks: the state says why (BNB_GC_FIX unset)" in fixed["said"]
    job = f"state: unprotected: the modules a job here quantizes with replace_parameter_4bit run {named}'s"
    assert job in fixed["command"], fixed["command"]


def test_a_pair_binding_p_as_a_default_through_a_helper_is_never_called_by_the_fix(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    # Issue 54's finding 1: d75b8f8 ran copies of these hooks against a stand-in while the module was
    # quantized (4 calls, counted through their default), wrote the real counter, and read them as hooks
    # that never switch the cache. The control calls them 0 times; so does the fix, and says it cannot
    # read them.
    name = "a pair binding P as a default, through a helper"
    fixed, control = _fixed_and_control(installed_releases, name)
    assert control["counted"][0] == fixed["counted"][0] == 0  # while replace_parameter_4bit ran
    assert control["counted"][1] == fixed["counted"][1] > 0  # the steps' own calls: the count counts
    assert fixed["counters"] == control["counters"] == [2, 4, 6] and fixed["state"] == "unprotected"
    assert (
        "the code of bitsandbytes.nn.parametrize._register_parametrization_hooks() does not say"
        in (fixed["said"])
    )


def test_no_register_function_is_named_as_the_reason_its_hooks_cannot_be_read(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, _ = _fixed_and_control(installed_releases, "the leaking pair, renamed")
    assert (
        f"bnb-gc-fix cannot read its hooks (bitsandbytes.nn.parametrize has no Python function {REGISTER}())"
        in (fixed["warnings"][0])
    )
    assert "cache: on, counter 6, " in fixed["said"] and "left on by bitsandbytes' own hooks" in fixed["said"]


def test_force_puts_the_fix_only_into_hooks_it_recognises(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    for name in ("the leaking pair, renamed", "builtins as hooks"):
        folder, version = installed_releases[name]
        forced = _run(folder, version, "force")
        [warning] = forced["warnings"]
        assert f"bnb-gc-fix is not in bitsandbytes {version}: bnb-gc-fix cannot read its hooks (" in warning
        assert forced["counters"] == UNREADABLE[name] and forced["fixed"] is False
    folder, version = installed_releases["the installed pair, always called"]
    forced = _run(folder, version, "force")  # hooks it recognises that do not leak: force puts it in
    assert forced["warnings"] == [] and forced["fixed"] is True and forced["state"] == "protected"
    assert forced["counters"] == [0, 0, 0]


# --- the fixed line's code (bitsandbytes 0.50.2, downloaded) ---------------------------------------------


@pytest.fixture(scope="module")
def fixed_releases(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, tuple[Path, str]], dict[str, str]]:
    downloaded = pip_target("bitsandbytes==0.50.2")
    made = {}
    for name, (version, changes) in FROM_0_50_2.items():
        folder = tmp_path_factory.mktemp("release") / re.sub(r"\W+", "-", name)
        made[name] = (
            _release(folder, downloaded / "bitsandbytes" / "nn" / "parametrize.py", changes),
            version,
        )
    return made, environment(PYTHONPATH=str(downloaded))


@pytest.mark.downloads
@pytest.mark.parametrize("switch", [None, "0", "force"])
def test_the_fixed_pair_renamed_cannot_be_read_and_the_fix_stays_out(
    fixed_releases: tuple[dict[str, tuple[Path, str]], dict[str, str]], switch: str | None
) -> None:
    releases, env = fixed_releases
    folder, version = releases["the fixed pair, renamed"]
    run = _run(folder, version, switch, env=env)
    assert run["counters"] == [0, 0, 0]  # upstream's fix, whatever the switch
    if switch == "0":
        assert run["warnings"] == [] and run["state"] is None
        return
    [warning] = run["warnings"]
    assert warning.startswith(
        f"bnb-gc-fix is not in bitsandbytes {version}: bnb-gc-fix cannot read its hooks "
        f"(bitsandbytes.nn.parametrize has no Python function {REGISTER}())"
    )
    assert run["state before"] == "not affected" and run["state"] == "unprotected"  # it cannot tell
    assert run["fixed"] is False


@pytest.mark.downloads
@pytest.mark.parametrize(
    "name", ["the fixed pair, an old version number", "a development build after the fix"]
)
def test_the_fixed_pair_steps_aside_whatever_its_version_says(
    fixed_releases: tuple[dict[str, tuple[Path, str]], dict[str, str]], name: str
) -> None:
    releases, env = fixed_releases
    folder, version = releases[name]
    run = _run(folder, version, None, env=env)
    control = _run(folder, version, "0", env=env)
    assert run["counters"] == control["counters"] == [0, 0, 0] and run["calls"] == control["calls"]
    assert run["warnings"] == [] and run["state"] == "not affected" and run["fixed"] is False
    assert f"bitsandbytes {version}'s hooks switch the cache off even when a forward raises" in run["said"]
    assert f"fix: not needed here: the hooks of bitsandbytes {version} do not leak this way" in run["said"]
    assert "state: not affected: " in run["command"]
