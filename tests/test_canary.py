"""The canary: what bnb-gc-fix relies on inside torch and bitsandbytes, checked on the installed releases.

The fix edits torch's module hook dictionaries, counts on torch's global parametrization cache, finds a
module's live calls by the frames of ``Module._call_impl`` (and the copies torch.compile makes of them),
and wraps bitsandbytes' functions by name. None of that is a public API: a new release may change any of
it. Each test here states one such fact and fails loudly (it never skips) when the installed release no
longer has it; the cell ``latest`` (cells.toml) runs it on the newest torch, bitsandbytes and
transformers of the day, and the README's test command and every stack cell run it too.

The facts are measured in one fresh interpreter with the fix switched off (tests/scenarios/canary.py),
so that what is looked at is the libraries' own code; the range the expectations depend on is the
package's (conftest.FIRST_AFFECTED, FIRST_FIXED).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from conftest import AFFECTED, BITSANDBYTES, FIRST_AFFECTED, SCENARIOS, TORCH, run_python
from packaging.version import Version

pytestmark = [pytest.mark.canary, pytest.mark.stack]

ENABLE = "_enable_parametrization_cache"
DISABLE = "_disable_parametrization_cache"
RESUME = "torch_dynamo_resume_in_"


@cache
def facts() -> dict[str, Any]:
    run = run_python([str(SCENARIOS / "canary.py")], switch="0", timeout=600)
    assert run.returncode == 0, f"the canary's probe crashed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    found: dict[str, Any] = run.last_json
    return found


def fact(group: str, name: str) -> Any:
    value = facts()[group].get(name)
    where = f"{group}.{name} (torch {TORCH}, bitsandbytes {BITSANDBYTES})"
    assert not (isinstance(value, str) and value.startswith("error: ")), (
        f"{where} could not be measured: {value}"
    )
    return value


# --- torch.nn.Module ----------------------------------------------------------------------------------


def test_module_calls_run_through_call_impl() -> None:
    """The gate recognises a live call of a module by a frame of ``Module._call_impl`` (its code object)
    whose local ``self`` is the module; ``Module.__call__`` reaches it through ``_wrapped_call_impl``."""
    assert fact("torch", "call_impl") == {
        "is_function_with_code": True,
        "name": "_call_impl",
        "__call__": "_wrapped_call_impl",
    }


def test_hooks_and_forward_run_inside_the_modules_own_call_impl_frame() -> None:
    """A forward pre-hook, the forward and a forward hook each run with exactly one frame of
    ``_call_impl`` of their module below them: a hold taken in a pre-hook is owned by that frame."""
    assert fact("torch", "frames_seen_by_hooks_and_forward") == {
        "pre_hook": ["_call_impl"],
        "forward": ["_call_impl"],
        "forward_hook": ["_call_impl"],
    }


def test_hook_dictionaries_are_keyed_by_handle_id() -> None:
    """The gate edits ``_forward_pre_hooks``, ``_forward_pre_hooks_with_kwargs``, ``_forward_hooks``,
    ``_forward_hooks_with_kwargs`` and ``_forward_hooks_always_called`` by the handles' ids."""
    found = fact("torch", "hook_dictionaries")
    assert all(found["ordered_dicts"].values()), found
    assert {key: value for key, value in found.items() if key != "ordered_dicts"} == {
        "pre_hook_keys": True,
        "pre_with_kwargs": True,
        "hook_keys": True,
        "hook_with_kwargs": True,
        "always_called": True,
    }


def test_torch_runs_what_the_hook_dictionaries_hold_in_their_order() -> None:
    """A hook assigned to an existing key runs in that key's place (the gate takes the place of the pair
    it replaces), a deleted key's hook no longer runs, and an OrderedDict subclass of one's own as
    ``_forward_hooks_always_called`` is honoured (the gate's, which pickles without its entry)."""
    assert fact("torch", "hooks_run_from_the_dictionaries") == ["pre-a", "pre-replaced", "post-b"]


def test_only_always_called_hooks_run_when_a_forward_raises_and_none_on_keyboard_interrupt() -> None:
    """An Exception leaving a forward (checkpointing's early stop) runs always-called hooks only, which is
    why the gate's forward hook is one; a BaseException (Ctrl-C) runs none, which is what the gate's
    healing at the next forward is for."""
    assert fact("torch", "hooks_when_the_forward_raises") == {
        "RuntimeError": ["always_call"],
        "KeyboardInterrupt": [],
    }


# --- torch.nn.utils.parametrize -----------------------------------------------------------------------


def test_parametrize_cache_globals() -> None:
    """``torch.nn.utils.parametrize._cache_enabled`` (an int counter) and ``_cache`` (a dict), both 0/empty
    in a fresh interpreter."""
    assert fact("parametrize", "globals") == {"counter": ["int", 0], "cache": ["dict", 0]}


def test_parametrize_cached_block_counts_and_empties_at_zero() -> None:
    assert fact("parametrize", "cached_block") == {
        "inside": 1,
        "entries": 1,
        "same_tensor": True,
        "after": 0,
        "emptied": True,
    }


def test_parametrized_attributes_are_cached_whenever_the_counter_is_above_zero() -> None:
    """...in whatever dict the module global ``_cache`` is then: the gate releases by setting the counter
    and binding a fresh dict, as bitsandbytes' own disable function does."""
    assert fact("parametrize", "cache_follows_the_counter") == {"stored_while_on": 1, "stored_while_off": 0}


# --- torch.compile (Dynamo) ----------------------------------------------------------------------------


def test_compiler_switches() -> None:
    """``torch.compiler.is_dynamo_compiling`` (``torch._dynamo.is_compiling`` before 2.3) is folded to True
    in a trace and False in eager code; ``torch.compiler.disable`` keeps a function out of the trace."""
    assert fact("dynamo", "switches") == {
        "is_dynamo_compiling": True,
        "folded_true_when_traced": True,
        "false_in_eager": True,
        "disable_runs_eagerly": True,
    }


def test_dynamo_frames_keep_the_name_or_take_the_resume_prefix() -> None:
    """A function compiled with graph breaks runs as a transformed copy of its code (same name and file)
    and resume functions named ``torch_dynamo_resume_in_<name>_at_<line>``, both keeping ``self``: the
    gate recognises Dynamo's frames of ``_call_impl`` by exactly these names."""
    assert fact("dynamo", "frame_names") == [["_call_impl", True], [RESUME + "_call_impl", True]]


def test_compiled_module_calls_are_recognised_as_live_calls() -> None:
    """From eager code in a compiled module's pre-hook, forward and forward hook, the stack holds a frame of
    the module's call that the gate recognises, and torch's module file shows no frame of a name the gate
    does not know."""
    found = fact("dynamo", "compiled_module_calls")
    known = {"_call_impl", "_wrapped_call_impl", "inner"}
    unknown = [name for name in found["names"] if name not in known and not name.startswith(RESUME)]
    assert unknown == [], f"frames of torch's module file the gate does not know: {unknown}"
    assert len(found["recognised"]) >= 3 and all(found["recognised"].values()), found["recognised"]


# --- bitsandbytes ----------------------------------------------------------------------------------------


def test_bitsandbytes_is_installed_with_the_parametrize_module() -> None:
    assert BITSANDBYTES is not None and Version(BITSANDBYTES) >= Version(FIRST_AFFECTED), BITSANDBYTES
    assert facts()["bitsandbytes"].get("import") is None, facts()["bitsandbytes"]
    assert fact("bitsandbytes", "version") == BITSANDBYTES
    assert fact("bitsandbytes", "target_module") is True  # the module the package patches


def test_bitsandbytes_functions_and_signatures() -> None:
    """Every (function, positional arguments) the package checks before wrapping (its targets), and
    ``replace_parameter_4bit(module, param_name, ...)``."""
    found = fact("bitsandbytes", "signatures")
    assert found.pop("register") is True
    assert found == {name: True for name in found} and "replace_parameter_4bit" in found, found
    assert {ENABLE, DISABLE} <= set(found), found


def test_bitsandbytes_registers_one_named_pair_per_parameter() -> None:
    """What the package's probe and the gate recognise: one enable pre-hook and one disable forward hook,
    by these names, from bitsandbytes.nn.parametrize; plain in the affected range, always-called after."""
    expected = {
        "pre_hooks": [ENABLE],
        "forward_hooks": [DISABLE],
        "from": ["bitsandbytes.nn.parametrize"],
        "always_called": not AFFECTED,
    }
    found = fact("bitsandbytes", "registered_pair")
    assert found == {"replace_parameter_4bit": expected, "_register_parametrization_hooks": expected}


def test_bitsandbytes_pair_drives_torchs_counter() -> None:
    assert fact("bitsandbytes", "enable_and_disable") == {
        "enable_adds": 1,
        "disable_back_to": 0,
        "emptied": True,
    }


def test_a_4bit_forward_caches_its_dequantized_weight() -> None:
    assert fact("bitsandbytes", "forward_caches_the_dequantized_weight") == {
        "during": {"counter": 1, "entries": 1},
        "after": [0, 0],
    }
