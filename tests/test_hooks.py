"""The fix on an affected bitsandbytes: a forward left early (checkpointing, Ctrl-C) no longer leaves the
cache on, with outputs and losses unchanged. Each test pairs the fix with a control that leaks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import AFFECTED, FIX, run_code, tiny_olmoe, tiny_olmoe_control

# --- the bug report's reproduction -------------------------------------------------------------


@pytest.mark.stack
def test_tiny_olmoe_with_fix_ends_every_step_at_zero(record_property: Any) -> None:
    run = tiny_olmoe("--steps", "5", "--import-fix")
    record_property("matrix", json.dumps("fix"))  # the stack cells' row in docs/matrix.md
    record_property("counters", [s["counter"] for s in run.steps])
    record_property("state", json.dumps(run.summary["state"]))
    assert len(run.steps) == 5
    assert [s["counter"] for s in run.steps] == [0] * 5
    assert [s["cache_bytes"] for s in run.steps] == [0] * 5
    # on a fixed bitsandbytes the fix steps aside: upstream's own pair holds
    assert run.summary["state"] == ("protected" if AFFECTED else "not affected")
    assert run.summary["error"] is None


@pytest.mark.stack
def test_tiny_olmoe_control_leaks_without_fix(record_property: Any) -> None:
    run = tiny_olmoe_control()
    counters = [s["counter"] for s in run.steps]
    record_property("matrix", json.dumps("control"))
    record_property("counters", counters)
    assert run.summary["asked_by"] is None
    if not AFFECTED:  # upstream's fix (>= 0.50): no leak even without the package
        assert counters == [0] * 5 and run.steps[-1]["cache_bytes"] == 0
        assert run.summary["state"] == "not affected"
        return
    assert run.summary["state"] == "unprotected"
    assert counters[0] > 0
    assert all(b > a for a, b in zip(counters, counters[1:])), counters
    assert run.steps[-1]["cache_bytes"] > 0


def test_losses_with_fix_equal_losses_without_checkpointing() -> None:
    fixed = tiny_olmoe("--steps", "5", "--import-fix")
    plain = tiny_olmoe("--steps", "5", "--import-fix", "--no-checkpointing")
    assert [s["counter"] for s in plain.steps] == [0] * 5  # no checkpointing: no leak anyway
    assert [s["loss"] for s in fixed.steps] == pytest.approx([s["loss"] for s in plain.steps], rel=1e-6)


# --- weight_norm beside quantized experts --------------------------------------------------------


def test_weight_norm_keeps_training_with_fix() -> None:
    run = tiny_olmoe("--steps", "4", "--import-fix", "--weight-norm")
    assert run.summary["error"] is None
    assert [s["weight_norm_changed"] for s in run.steps] == [True] * 4


def test_weight_norm_control_freezes_then_crashes() -> None:
    run = tiny_olmoe("--steps", "4", "--import-fix", "--weight-norm", switch="0")
    changed = [s.get("weight_norm_changed") for s in run.steps if "weight_norm_changed" in s]
    assert False in changed or run.summary["error"] is not None
    assert "backward through the graph a second time" in (run.summary["error"] or "")


# --- the tail module of a checkpointed chain ---------------------------------------------------

TAIL = """
import torch
from torch.utils.checkpoint import checkpoint
import quantized
import bnb_gc_fix
torch.manual_seed(0)
head = torch.nn.Linear(64, 64)
tail = quantized.make(params=2)   # its forward holds the last saved tensor of the chain
for p in tail.parameters():
    p.requires_grad_(False)
opt = torch.optim.SGD(head.parameters(), lr=0.1)
x = torch.randn(8, 64)
counters = []
for step in range(3):
    y = checkpoint(lambda v: tail(head(v).relu()), x, use_reentrant=False)
    y.pow(2).mean().backward()
    opt.step(); opt.zero_grad()
    counters.append(quantized.counter())
print(json.dumps(counters))
"""


def test_tail_module_of_checkpointed_chain() -> None:
    assert run_code(TAIL, prelude="scenarios").last_json == [0, 0, 0]


def test_tail_module_control_leaks() -> None:
    counters = run_code(TAIL, prelude="scenarios", switch="0").last_json
    assert counters[0] > 0 and counters[-1] > counters[0]


# --- KeyboardInterrupt -------------------------------------------------------------------------

INTERRUPT = """
import gc, torch
import quantized
import bnb_gc_fix
module = quantized.make(params=2)
x = torch.randn(4, 64)
after_interrupt = quantized.interrupted_forward(module, x)
module(x)
after_next_forward = quantized.counter()
before_delete = quantized.interrupted_forward(module, x)
del module
gc.collect()
after_delete = quantized.counter()
print(json.dumps([after_interrupt, after_next_forward, before_delete, after_delete]))
"""


@pytest.mark.stack
def test_keyboard_interrupt_heals_at_next_forward_and_on_collection() -> None:
    # FIX: auto on an affected bitsandbytes; force on a fixed one, whose Ctrl-C still leaks
    result = run_code(INTERRUPT, prelude="scenarios", switch=FIX)
    after_interrupt, after_next, before_delete, after_delete = json.loads(result.stdout)
    assert after_interrupt == 1  # torch ran no forward hook: the hold is still there...
    assert after_next == 0  # ...until the module's next forward releases it
    assert before_delete == 1
    assert after_delete == 0  # or until the module is garbage-collected


@pytest.mark.stack
def test_keyboard_interrupt_control_stays_stuck() -> None:
    control = run_code(INTERRUPT, prelude="scenarios", switch="0")
    after_interrupt, after_next, before_delete, after_delete = json.loads(control.stdout)
    assert after_interrupt == 2  # two plain pairs, both pre-hooks ran
    assert after_next == 2
    assert before_delete == after_delete == 4  # two more stuck holds, and nothing gives any back


# A deep copy outlives its original until the interpreter's last collection (torch's parametrize keeps
# the original reachable from the copy), which runs after module globals are torn down.
COLLECTED_AT_EXIT = """
import copy, torch
import quantized
import bnb_gc_fix
module = quantized.make(params=1)
module(torch.randn(2, 64))
kept = copy.deepcopy(module)
del module
kept(torch.randn(2, 64))
print(quantized.counter())
"""


@pytest.mark.parametrize("switch", [None, "0"], ids=["fix", "control"])
def test_a_module_collected_at_exit_prints_nothing(switch: str | None) -> None:
    result = run_code(
        COLLECTED_AT_EXIT, prelude="scenarios", switch=switch, fresh="the interpreter's teardown collects it"
    )
    assert result.last_line == "0"
    assert "Exception ignored" not in result.stderr, result.stderr  # was: a TypeError from the fix's code


# --- exact pairing -------------------------------------------------------------------------------

EARLIER_PRE_HOOK = """
import torch
import torch.nn.utils.parametrize as P
from torch.nn.modules.module import register_module_forward_pre_hook
import quantized
import bnb_gc_fix
from bitsandbytes.nn import parametrize
module = quantized.make(params=2)
if sys.argv[1] == "upstream-style":
    # The control (the fix off): bitsandbytes' own pair, its off hook always called, as bitsandbytes 0.50
    # has it (without its clamp): nothing pairs a switch-on with the call that made it.
    for key in list(module._forward_hooks):
        del module._forward_hooks[key]
    for key in list(module._forward_pre_hooks):
        del module._forward_pre_hooks[key]
    module.register_forward_pre_hook(parametrize._enable_parametrization_cache)
    module.register_forward_hook(parametrize._disable_parametrization_cache, always_call=True)

def refuse(module, args):
    if getattr(module, "names", None):
        raise ValueError("an earlier pre-hook refuses")

counts = []
with P.cached():                       # someone else's legitimate hold: counter 1
    handle = register_module_forward_pre_hook(refuse)
    for _ in range(3):
        try:
            module(torch.randn(2, 64))
        except ValueError:
            pass
        counts.append(int(P._cache_enabled))
    handle.remove()
counts.append(int(P._cache_enabled))
print(json.dumps(counts))
"""


def test_earlier_pre_hook_raising_never_switches_off_what_its_forward_did_not_switch_on() -> None:
    assert run_code(EARLIER_PRE_HOOK, "fix", prelude="scenarios").last_json == [1, 1, 1, 0]


def test_earlier_pre_hook_control_unpaired_always_call_hook_goes_wrong() -> None:
    counts = run_code(EARLIER_PRE_HOOK, "upstream-style", prelude="scenarios", switch="0").last_json
    assert counts[0] == 0  # the off hook released the outer cached() hold it never took


# --- one pair per module; activate() ----------------------------------------------------------------

PAIRING = """
import inspect
import torch
import torch.nn.utils.parametrize as P
from bitsandbytes.nn import parametrize
pair = (parametrize._enable_parametrization_cache, parametrize._disable_parametrization_cache)
own = [inspect.signature(function) for function in pair]
import quantized
plain = quantized.make(params=2)  # before the package turned the fix on: bitsandbytes' two plain pairs
import bnb_gc_fix

def pairing(module):
    # [the counter inside a forward, the counter a forward raising an Exception leaves]: [1, 0] for one
    # always-called pair per module, [2, 2] for bitsandbytes' plain pair per parameter of two parameters.
    x = torch.randn(2, 64)
    inside = []
    handle = module.register_forward_hook(lambda m, a, o: inside.append(int(P._cache_enabled)), prepend=True)
    module(x)
    handle.remove()
    try:
        module(x, fail=True)
    except RuntimeError:
        pass
    left = int(P._cache_enabled)
    bnb_gc_fix.reset()
    return [inside[0], left]

facts = {}
bnb_gc_fix.activate()
bnb_gc_fix.activate()
facts["covered"] = pairing(quantized.make(params=2))
facts["quantized before, at its next forward"] = pairing(plain)
facts["state"] = bnb_gc_fix.status().state
facts["signatures"] = [inspect.signature(function) == mine for function, mine in zip(pair, own)]
facts["shown"] = str(inspect.signature(pair[0]))
print(json.dumps(facts))
"""


def test_activate_is_idempotent_one_always_called_pair_per_module_and_the_signatures_are_bitsandbytes() -> (
    None
):
    facts = run_code(PAIRING, prelude="scenarios-without-startup-hook").last_json
    control = run_code(PAIRING, prelude="scenarios-without-startup-hook", switch="0").last_json
    assert control["covered"] == control["quantized before, at its next forward"] == [2, 2]  # plain pairs
    assert facts["covered"] == [1, 0]  # one always-called pair for two quantized parameters
    assert facts["quantized before, at its next forward"] == [1, 0]  # covered by that forward
    assert facts["state"] == "protected"
    assert facts["signatures"] == control["signatures"] == [True, True]  # help() shows bitsandbytes' own
    assert facts["shown"] == control["shown"] and "_P" not in facts["shown"], facts["shown"]


# --- threads -------------------------------------------------------------------------------------

THREADS = """
import threading, torch
import bnb_gc_fix, quantized
torch.set_num_threads(1)
shared = [quantized.make(params=2), quantized.make(params=1)]
x = torch.randn(2, 64)

def work(seed):
    for i in range(300):
        try:
            # now and then a forward that raises, as checkpoint's early stop does
            shared[(seed + i) % 2](x, fail=i % 10 == 0)
        except RuntimeError:
            pass

threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(quantized.counter()))
"""


@pytest.mark.stack
def test_threads_end_with_counter_at_zero() -> None:
    assert run_code(THREADS, prelude="scenarios", switch=FIX).last_json == 0


@pytest.mark.stack
def test_threads_control_leaks_on_raising_forwards() -> None:
    counter = run_code(THREADS, prelude="scenarios", switch="0").last_json
    assert counter > 0 if AFFECTED else counter == 0  # upstream's always_call hook pairs them


# --- the hooks' code runs with the library's globals ------------------------------------------------


def _names_looked_up(code: Any) -> set[str]:
    """The names the code (and the code it holds) looks up in its module's globals, then in the builtins:
    every name it does not bind itself, ``id`` and ``next`` included."""
    import dis

    loads = ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL")
    names = {i.argval for i in dis.get_instructions(code) if i.opname in loads}
    for held in code.co_consts:
        if hasattr(held, "co_code"):
            names |= _names_looked_up(held)
    return names


def test_the_hooks_code_loads_no_global_not_even_a_builtin() -> None:
    """The two functions' code runs as the library's hook functions, whose globals are the library's
    module: a name looked up there would be the library's, or missing, and a builtin the library's module
    shadows (or its ``__builtins__``) would be another function."""
    from bnb_gc_fix import hooks, ledger

    assert _names_looked_up(hooks.pre_hook.__code__) == set()
    assert _names_looked_up(hooks.off_hook.__code__) == set()
    # The control: a function of the package that looks up a global and two builtins.
    assert _names_looked_up(ledger.switch_off_since.__code__) == {"local", "list", "len"}
