"""Tomorrow's bitsandbytes: the fix decided by what a release's code does, never by its version or the
names of its hooks (issue 47). Each release here is built by the test from a real one: the installed
bitsandbytes' own ``nn/parametrize.py``, changed as a later release (or a development build) might change
it, is what ``bitsandbytes.nn.parametrize`` imports (a folder first on ``bitsandbytes.nn.__path__``), and
``bitsandbytes.__version__`` says what that release would say; bitsandbytes 0.50.2's code (downloaded)
for the releases built on the fixed line. Each runs beside its control, the same release with the fix
off: where the control runs, the fixed run runs too, and ends no worse; a warning only where modules
leak and the fix cannot go in.
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
PAIR = (
    "    module.register_forward_pre_hook(_enable_parametrization_cache)\n"
    "    module.register_forward_hook(_disable_parametrization_cache)\n"
)
RENAMED = {
    REGISTER: "_add_parametrization_cache_hooks",
    "_enable_parametrization_cache": "_cache_on",
    "_disable_parametrization_cache": "_cache_off",
}

# What each release built from the installed (leaking) code changes in it.
FROM_THE_INSTALLED = {
    # bitsandbytes' own main between the 0.49.2 tag and the fix said 0.50.0.dev0, with the plain pair.
    "a development build of the fixed line": ("0.50.0.dev0", {}),
    "a register function that raises on a throwaway module": (
        BITSANDBYTES,
        {
            f"def {REGISTER}(module: nn.Module, param_name: str):\n": (
                f"def {REGISTER}(module: nn.Module, param_name: str):\n"
                "    module.parametrizations[param_name]  # only a module quantized already has it\n"
            )
        },
    ),
    "a register function that registers nothing": (BITSANDBYTES, {PAIR: ""}),
    "hook functions wrapped in functools.partial": (
        BITSANDBYTES,
        {
            PAIR: (
                "    module.register_forward_pre_hook(partial(_enable_parametrization_cache))\n"
                "    module.register_forward_hook(partial(_disable_parametrization_cache))\n"
            )
        },
    ),
    "functools.partial hooks, always called": (
        BITSANDBYTES,
        {
            PAIR: (
                "    module.register_forward_pre_hook(partial(_enable_parametrization_cache))\n"
                "    module.register_forward_hook(\n"
                "        partial(_disable_parametrization_cache), always_call=True\n"
                "    )\n"
            )
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
    # Issue 51: an always-called pair of plain functions, and plain functions that do something else.
    "the installed pair, always called": (
        BITSANDBYTES,
        {
            "    module.register_forward_hook(_disable_parametrization_cache)\n": (
                "    module.register_forward_hook(_disable_parametrization_cache, always_call=True)\n"
            )
        },
    ),
    "plain functions that switch the cache by two": (
        BITSANDBYTES,
        {
            "P._cache_enabled += 1\n": "P._cache_enabled += 2\n",
            "P._cache_enabled -= 1\n": "P._cache_enabled -= 2\n",
        },
    ),
}
# ...and from bitsandbytes 0.50.2's (fixed) code.
FROM_0_50_2 = {
    "the fixed pair, renamed": ("0.51.0", RENAMED),
    "the fixed pair, an old version number": ("0.49.2", {}),
}

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


# A user's script on that release: quantize, three checkpointed steps, and what the package said.
RELEASE = """
import warnings
import bitsandbytes, bitsandbytes.nn
bitsandbytes.__version__ = sys.argv[2]
bitsandbytes.nn.__path__.insert(0, sys.argv[1])  # its nn/parametrize.py is the release's
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from bitsandbytes.nn import parametrize
    import quantized
    model = quantized.make(params=2)
    counters = quantized.checkpointed_counters(model, steps=3)
assert parametrize.__file__.startswith(sys.argv[1]), parametrize.__file__
fix = sys.modules.get("bnb_gc_fix")
status = fix.status() if fix is not None else None
ours = [w for w in caught if fix is not None and isinstance(w.message, fix.BnbGcFixWarning)]
print(json.dumps({
    "counters": counters,
    "warnings": [str(w.message) for w in ours],
    "state": status and status.state,
    "lines": status and status.lines(),
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
    facts["said"] = unwrapped("\n".join(facts["lines"] or []))
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
    return fixed, control


def test_a_development_build_of_the_fixed_line_carrying_the_leaking_pair_gets_the_fix(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "a development build of the fixed line")
    assert control["counters"] == [2, 4, 6]  # two plain pairs, each left on by every recompute
    assert fixed["counters"] == [0, 0, 0] and fixed["warnings"] == []
    assert fixed["state"] == "protected"
    # The release number says it is of the fixed line; what its code does decides, and status says so.
    assert (
        "the fix covers 1 module quantized here with replace_parameter_4bit (bitsandbytes 0.50.0.dev0 does, "
        "though only releases 0.48.0 to before 0.50.0 did)"
    ) not in fixed["said"]  # 0.50.0.dev0 comes before 0.50.0: no disagreement
    assert (
        "state: protected: the fix covers 1 module quantized here with replace_parameter_4bit"
        in fixed["said"]
    )


def test_a_register_function_that_raises_on_a_throwaway_module_is_read_on_the_first_real_one(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(
        installed_releases, "a register function that raises on a throwaway module"
    )
    assert control["counters"] == [2, 4, 6]
    assert fixed["counters"] == [0, 0, 0] and fixed["warnings"] == [] and fixed["state"] == "protected"


def test_a_register_function_that_registers_nothing_needs_no_fix_and_says_so(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "a register function that registers nothing")
    assert control["counters"] == fixed["counters"] == [0, 0, 0]
    assert fixed["warnings"] == [] and fixed["state"] == "not affected"
    assert f"{REGISTER}() registers no forward hooks" in fixed["said"]
    assert (
        f"(bitsandbytes {BITSANDBYTES} does not, though releases 0.48.0 to before 0.50.0 do)" in fixed["said"]
    )
    assert (
        f"fix: not needed here: the hooks of bitsandbytes {BITSANDBYTES} do not leak this way"
        in fixed["said"]
    )


def test_leaking_hooks_wrapped_in_partial_objects_warn_once_and_change_nothing(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "hook functions wrapped in functools.partial")
    assert control["counters"] == fixed["counters"] == [2, 4, 6]  # nothing changed: no worse
    [warning] = fixed["warnings"]
    assert warning.startswith("bnb-gc-fix is not active for bitsandbytes: ")
    assert "registers an off hook that torch skips when a forward raises" in warning
    assert "not plain Python functions" in warning
    assert fixed["state"] == "unprotected" and "the fix could not be put in" in fixed["said"]


@pytest.mark.parametrize("name", ["functools.partial hooks, always called", "builtins as hooks"])
def test_hooks_that_do_not_leak_get_no_warning(
    installed_releases: dict[str, tuple[Path, str]], name: str
) -> None:
    fixed, control = _fixed_and_control(installed_releases, name)
    assert control["counters"] == fixed["counters"] == [0, 0, 0]
    assert fixed["warnings"] == [] and fixed["state"] == "not affected"


def test_the_leaking_pair_renamed_is_said_in_status_and_warns_nobody(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "the leaking pair, renamed")
    assert control["counters"] == fixed["counters"] == [2, 4, 6]
    assert fixed["warnings"] == []
    assert fixed["state"] == "unprotected"  # its modules leak, and status counts them
    assert f"bitsandbytes.nn.parametrize has no {REGISTER}()" in fixed["said"]
    assert "cache: on, counter 6, " in fixed["said"] and "left on by bitsandbytes' own hooks" in fixed["said"]


def test_force_puts_the_fix_only_into_hooks_it_recognises(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    folder, version = installed_releases["the leaking pair, renamed"]
    forced = _run(folder, version, "force")
    [warning] = forced["warnings"]
    assert (
        f"bitsandbytes.nn.parametrize has no {REGISTER}(), so bnb-gc-fix cannot tell what its hooks do"
        in warning
    )
    assert forced["counters"] == [2, 4, 6] and forced["state"] == "unprotected"
    folder, version = installed_releases["builtins as hooks"]
    forced = _run(folder, version, "force")
    [warning] = forced["warnings"]
    assert "registers forward hooks that bnb-gc-fix cannot read (they are not Python functions)" in warning
    assert forced["counters"] == [0, 0, 0]


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


def test_plain_functions_that_do_something_else_to_the_cache_are_left_as_they_are(
    installed_releases: dict[str, tuple[Path, str]],
) -> None:
    fixed, control = _fixed_and_control(installed_releases, "plain functions that switch the cache by two")
    assert control["counters"] == fixed["counters"] == [4, 8, 12]  # their own code: nothing changed
    assert fixed["warnings"] == []  # nothing the fix can read as leaking this way
    assert fixed["state"] == "unprotected"  # their modules leak, and status says it cannot read them
    assert (
        "registers forward hooks that bnb-gc-fix cannot read (they do something else to the cache)"
        in (fixed["said"])
    )


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
def test_the_fixed_pair_renamed_is_silent_and_force_warns(
    fixed_releases: tuple[dict[str, tuple[Path, str]], dict[str, str]], switch: str | None
) -> None:
    releases, env = fixed_releases
    folder, version = releases["the fixed pair, renamed"]
    run = _run(folder, version, switch, env={**env, **({"BNB_GC_FIX": switch} if switch else {})})
    assert run["counters"] == [0, 0, 0]  # upstream's fix, whatever the switch
    if switch == "0":
        assert run["warnings"] == [] and run["state"] is None
        return
    if switch is None:
        assert run["warnings"] == [] and run["state"] == "not affected"
        assert f"bitsandbytes.nn.parametrize has no {REGISTER}()" in run["said"]
        return
    [warning] = run["warnings"]
    assert "cannot tell what its hooks do" in warning and run["state"] == "not affected"


@pytest.mark.downloads
def test_the_fixed_pair_steps_aside_whatever_its_version_says(
    fixed_releases: tuple[dict[str, tuple[Path, str]], dict[str, str]],
) -> None:
    releases, env = fixed_releases
    folder, version = releases["the fixed pair, an old version number"]
    run = _run(folder, version, None, env=env)
    assert run["counters"] == [0, 0, 0] and run["warnings"] == [] and run["state"] == "not affected"
    assert "bitsandbytes 0.49.2's hooks switch the cache off even when a forward raises" in run["said"]
    assert "(bitsandbytes 0.49.2 does not, though releases 0.48.0 to before 0.50.0 do)" in run["said"]
    assert "fix: not needed here: the hooks of bitsandbytes 0.49.2 do not leak this way" in run["said"]
