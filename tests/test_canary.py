"""The canary: what bnb-gc-fix relies on inside torch and bitsandbytes, checked on the installed releases.

The fix edits torch's module hook dictionaries, counts on torch's global parametrization cache, reads
bitsandbytes' register function's code, gives the two hook functions it finds its code, and wraps the
register function. None of that is a public API
of torch or bitsandbytes: a new release may change any of it. Each test here states one such fact
and fails loudly (it never skips) when the installed release no longer has it; the cell ``latest``
(cells.toml) runs it on the newest torch, bitsandbytes and transformers of the day, and the README's
test command and every stack cell run it too.

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


def test_hook_dictionaries_are_keyed_by_handle_id() -> None:
    """The fix edits ``_forward_pre_hooks``, ``_forward_pre_hooks_with_kwargs``, ``_forward_hooks``,
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
    """A hook assigned to an existing key runs in that key's place, a deleted key's hook no longer runs,
    and a key put into ``_forward_hooks_always_called`` by hand makes its hook run when a pre-hook raises
    (the fix folds a module's pairs into one, its off hook always called)."""
    expected = ["pre-a", "pre-replaced", "post-b", "pre-a", "pre-replaced", "post-b", "raised"]
    assert fact("torch", "hooks_run_from_the_dictionaries") == expected


def test_only_always_called_hooks_run_when_a_forward_raises_and_none_on_keyboard_interrupt() -> None:
    """An Exception leaving a forward (checkpointing's early stop) runs always-called hooks only, which is
    why the fix's forward hook is one; a BaseException (Ctrl-C) runs none, which is why the fix switches
    off what a module's forward left on at that module's next forward."""
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
    """...in whatever dict the module global ``_cache`` is then: the fix releases by setting the counter
    and binding a fresh dict, as bitsandbytes' own disable function does."""
    assert fact("parametrize", "cache_follows_the_counter") == {"stored_while_on": 1, "stored_while_off": 0}


# --- torch.compile (Dynamo) ----------------------------------------------------------------------------


def test_compiler_switches() -> None:
    """``torch.compiler.is_dynamo_compiling`` is folded to True in a trace and False in eager code (a
    switch-on made in a trace gets the one ticket ``ledger.COMPILED``, so Dynamo compiles no graph anew for
    each)."""
    assert fact("dynamo", "switches") == {"folded_true_when_traced": True, "false_in_eager": True}


# --- bitsandbytes ----------------------------------------------------------------------------------------


def test_bitsandbytes_is_installed_with_the_parametrize_module() -> None:
    assert BITSANDBYTES is not None and Version(BITSANDBYTES) >= Version(FIRST_AFFECTED), BITSANDBYTES
    assert facts()["bitsandbytes"].get("import") is None, facts()["bitsandbytes"]
    assert fact("bitsandbytes", "version") == BITSANDBYTES
    assert fact("bitsandbytes", "target_module") is True  # the module the package patches


def test_bitsandbytes_functions() -> None:
    """The register function the fix reads (by its name; renamed, the fix cannot read the hooks and says
    so) and ``replace_parameter_4bit(module, param_name, ...)``."""
    found = fact("bitsandbytes", "functions")
    assert found == {"_register_parametrization_hooks": True, "replace_parameter_4bit": True}


def test_the_package_reads_the_installed_release() -> None:
    """What reading.py reads of the installed release's code: the leaking pair in the affected range, an
    always-called one after, either one the fix can take the place of."""
    assert fact("bitsandbytes", "read") == {
        "hooks": "leak this way" if AFFECTED else "do not leak this way",
        "pair": True,
    }


def test_a_hook_function_given_other_code_keeps_its_identity_and_a_module_runs_the_new_code() -> None:
    assert fact("bitsandbytes", "code_replaced_in_place") == {
        "ran": ["other"],
        "same_object": True,
        "counter": 0,
    }


def test_bitsandbytes_registers_one_pair_per_parameter() -> None:
    """What the fix covers: one pre-hook and one off hook per parameter, bitsandbytes' own functions; plain
    in the affected range, always-called after."""
    expected = {
        "pre_hooks": 1,
        "forward_hooks": 1,
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
