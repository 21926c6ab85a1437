"""The cache gate on an affected bitsandbytes: a forward left early (checkpointing, Ctrl-C) no longer leaves
the cache on, with outputs and losses unchanged. Each test pairs the fix with a control that leaks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import AFFECTED, FIX, run_code, tiny_olmoe

# --- the bug report's reproduction -------------------------------------------------------------


@pytest.mark.stack
def test_tiny_olmoe_with_fix_ends_every_step_at_zero(record_property: Any) -> None:
    run = tiny_olmoe("--steps", "5", "--import-fix")
    record_property("counters", [s["counter"] for s in run.steps])
    record_property("active", run.summary["active"])
    assert len(run.steps) == 5
    assert [s["counter"] for s in run.steps] == [0] * 5
    assert [s["cache_bytes"] for s in run.steps] == [0] * 5
    assert run.summary["active"] is AFFECTED  # on a fixed bitsandbytes it steps aside: upstream holds
    assert run.summary["error"] is None


@pytest.mark.stack
def test_tiny_olmoe_control_leaks_without_fix(record_property: Any) -> None:
    run = tiny_olmoe("--steps", "5", "--import-fix", switch="0")
    counters = [s["counter"] for s in run.steps]
    record_property("counters", counters)
    assert run.summary["active"] is False
    if not AFFECTED:  # upstream's fix (>= 0.50): no leak even without the package
        assert counters == [0] * 5 and run.steps[-1]["cache_bytes"] == 0
        return
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


NESTED = """
import torch
import quantized
import bnb_gc_fix

class Recursive(quantized.Quantized):
    def forward(self, x, depth=0):
        out = super().forward(x)
        if depth == 0:
            try:
                self(x, 1)              # a nested call of the same module, interrupted
            except KeyboardInterrupt:
                pass
            seen.append(quantized.counter())
            out = out + self(x, 2)      # heals the abandoned inner hold, keeps the outer one
            seen.append(quantized.counter())
        elif depth == 1:
            raise KeyboardInterrupt
        return out

seen = []
torch.manual_seed(0)
module = quantized.quantize(Recursive(params=1))
module(torch.randn(2, 64))
seen.append(quantized.counter())
print(json.dumps(seen))
"""


def test_nested_call_keeps_its_hold_while_abandoned_one_is_released() -> None:
    result = run_code(NESTED, prelude="scenarios")
    assert json.loads(result.stdout) == [2, 1, 0]


# --- exact pairing -------------------------------------------------------------------------------

EARLIER_PRE_HOOK = """
import torch
import torch.nn.utils.parametrize as P
from torch.nn.modules.module import register_module_forward_pre_hook
import quantized
import bnb_gc_fix
from bitsandbytes.nn import parametrize
module = quantized.make(params=2)
mode = sys.argv[1]
if mode == "upstream-style":
    # The control: a disable hook registered always_call=True without exact pairing.
    bnb_gc_fix.deactivate()
    for key, hook in list(module._forward_hooks.items()):
        del module._forward_hooks[key]
    for key, hook in list(module._forward_pre_hooks.items()):
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


def test_earlier_pre_hook_raising_never_releases_a_hold_it_did_not_take() -> None:
    result = run_code(EARLIER_PRE_HOOK, "gate", prelude="scenarios")
    assert json.loads(result.stdout) == [1, 1, 1, 0]


def test_earlier_pre_hook_control_unpaired_always_call_hook_goes_wrong() -> None:
    result = run_code(EARLIER_PRE_HOOK, "upstream-style", prelude="scenarios")
    counts = json.loads(result.stdout)
    assert counts[0] == 0  # the hook released the outer cached() hold it never took


def test_direct_disable_call_never_goes_below_zero() -> None:
    code = """
import torch.nn.utils.parametrize as P
import bnb_gc_fix
from bitsandbytes.nn import parametrize
P._cache["stale"] = object()
parametrize._disable_parametrization_cache(None, (), None)
print(json.dumps([int(P._cache_enabled), len(P._cache)]))
"""
    fixed = run_code(code, prelude="scenarios")
    control = run_code(code, prelude="scenarios", switch="0")
    assert json.loads(fixed.stdout) == [0, 0]
    assert json.loads(control.stdout)[0] == -1  # control: bitsandbytes' own


# --- one gate per module, repair, deactivate, idempotence --------------------------------------

HOOKS = """
import torch
import torch.nn.utils.parametrize as P
from bitsandbytes.nn import parametrize
originals = (parametrize._register_parametrization_hooks, parametrize._disable_parametrization_cache)
import bnb_gc_fix
import quantized

def pairing(module):
    # [the counter inside a forward, the counter a forward raising an Exception leaves]: [1, 0] for one
    # always-called gate per module, [2, 2] for a plain pair per parameter of a two-parameter module.
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

bnb_gc_fix.activate()
bnb_gc_fix.activate()
patched = parametrize._register_parametrization_hooks is not originals[0]
module = quantized.make(params=2)
gated = pairing(module)
bnb_gc_fix.deactivate()  # once: after two activate() calls, bitsandbytes' own functions are back
current = (parametrize._register_parametrization_hooks, parametrize._disable_parametrization_cache)
restored = current == originals
plain = quantized.make(params=2)
plain_pairing = pairing(plain)
model = torch.nn.Sequential(plain, quantized.make(params=1), torch.nn.Linear(4, 4))
fixed = bnb_gc_fix.repair(model)
again = bnb_gc_fix.repair(model)
repaired = pairing(plain)
still_working = pairing(module)
none = bnb_gc_fix.repair(torch.nn.Sequential(torch.nn.Linear(2, 2)))
print(json.dumps(dict(
    patched=patched, gated=gated, restored=restored, plain_pairing=plain_pairing,
    fixed=fixed, again=again, repaired=repaired, still_working=still_working, none=none,
    status=bnb_gc_fix.status().reason,
)))
"""


def test_activate_is_idempotent_repair_and_deactivate() -> None:
    result = run_code(HOOKS, prelude="scenarios-without-startup-hook")
    facts = json.loads(result.stdout)
    assert facts["patched"]
    assert facts["gated"] == [1, 0]  # one gate for two quantized parameters, always-called
    assert facts["restored"]  # one deactivate() undid two activate(): the second wrapped nothing
    assert facts["plain_pairing"] == [2, 2]  # built while deactivated: two plain pairs, both left on
    assert facts["fixed"] == 2 and facts["again"] == 0
    assert facts["repaired"] == [1, 0]
    assert facts["still_working"] == [1, 0]  # a gate installed before deactivate() stays a gate
    assert facts["none"] == 0  # a model without quantized parameters: nothing to do
    assert facts["status"] == "deactivated by deactivate()"


REPAIR_TRAIN = """
import torch
from torch.utils.checkpoint import checkpoint
import bnb_gc_fix
bnb_gc_fix.deactivate()
import quantized
layers = torch.nn.ModuleList(quantized.make(params=2) for _ in range(2))
for layer in layers:
    for name, p in layer.named_parameters():
        p.requires_grad_(name.startswith("trainable"))
fixed = bnb_gc_fix.repair(layers) if sys.argv[1] == "repair" else 0
x = torch.randn(4, 64)
counters = []
for step in range(3):
    h = x
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=False)
    h.pow(2).mean().backward()
    counters.append(quantized.counter())
print(json.dumps([fixed, counters]))
"""


def test_repair_fixes_a_model_built_while_deactivated() -> None:
    result = run_code(REPAIR_TRAIN, "repair", prelude="scenarios")
    fixed, counters = json.loads(result.stdout)
    assert fixed == 2
    assert counters == [0, 0, 0]


def test_repair_control_model_built_while_deactivated_leaks() -> None:
    result = run_code(REPAIR_TRAIN, "no", prelude="scenarios")
    _, counters = json.loads(result.stdout)
    assert counters[-1] > counters[0] > 0


# --- threads -------------------------------------------------------------------------------------

THREADS = """
import threading, torch
import bnb_gc_fix, quantized
torch.set_num_threads(1)
shared = [quantized.make(params=2), quantized.make(params=1)]
x = torch.randn(2, 64)
errors = []

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
    result = run_code(THREADS, prelude="scenarios", switch=FIX)
    assert json.loads(result.stdout) == 0


@pytest.mark.stack
def test_threads_control_leaks_on_raising_forwards() -> None:
    result = run_code(THREADS, prelude="scenarios", switch="0")
    counter = json.loads(result.stdout)
    assert counter > 0 if AFFECTED else counter == 0  # upstream's always_call hook pairs them


# --- bitsandbytes internals that do not look as expected --------------------------------------

UNEXPECTED = """
import warnings
from bitsandbytes.nn import parametrize
change = sys.argv[1]  # bitsandbytes' internals changed before the fix is imported
if change == "other-signature":
    parametrize._register_parametrization_hooks = lambda module: None
elif change == "missing-function":
    del parametrize._disable_parametrization_cache
elif change == "registers-nothing":
    parametrize._register_parametrization_hooks = lambda module, name: None
else:
    raise SystemExit(f"unknown change {change!r}")
original = getattr(parametrize, "_register_parametrization_hooks", None)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import bnb_gc_fix
    bnb_gc_fix.activate()
ours = [str(w.message) for w in caught if isinstance(w.message, bnb_gc_fix.PatchSkippedWarning)]
untouched = getattr(parametrize, "_register_parametrization_hooks", None) is original
status = bnb_gc_fix.status()
print(json.dumps(dict(active=status.active, reason=status.reason, warnings=ours, untouched=untouched)))
"""


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("other-signature", "registering hooks on a probe module raised TypeError"),
        ("missing-function", "has no _disable_parametrization_cache()"),
        ("registers-nothing", "got 0 enable and 0 disable cache hooks"),
    ],
    ids=["other-signature", "missing-function", "registers-nothing"],
)
def test_unexpected_internals_mean_no_patch_and_one_warning(change: str, expected: str) -> None:
    result = run_code(UNEXPECTED, change, prelude="scenarios-without-startup-hook")
    facts = json.loads(result.stdout)
    assert facts["active"] is False
    assert expected in facts["reason"] and facts["reason"].endswith("nothing patched")
    assert len(facts["warnings"]) == 1 and expected in facts["warnings"][0]
    assert facts["untouched"]


LOOKALIKE = """
import torch
import torch.nn.utils.parametrize as P
from torch.utils.checkpoint import checkpoint
import bnb_gc_fix, quantized

# Another library's copy of the pair (axolotl's 8-bit MoE path defines functions of these names
# in its own module and registers them the same way), on a parametrization of its own.
def _enable_parametrization_cache(module, inputs):
    P._cache_enabled += 1

def _disable_parametrization_cache(module, inputs, output):
    P._cache_enabled -= 1
    if not P._cache_enabled:
        P._cache = {}

class Dequantize(torch.nn.Module):
    def forward(self, stored):
        return stored * 1.0

torch.manual_seed(0)
module = quantized.Quantized(params=2)
for name in module.names:
    getattr(module, name).requires_grad_(False)
    P.register_parametrization(module, name, Dequantize(), unsafe=True)
    module.register_forward_pre_hook(_enable_parametrization_cache)
    module.register_forward_hook(_disable_parametrization_cache)
fixed = bnb_gc_fix.repair(module) if sys.argv[1] == "repair" else 0
x = torch.randn(4, 64)
counters = []
for step in range(3):
    checkpoint(module, x, use_reentrant=False).pow(2).mean().backward()
    counters.append(quantized.counter())
print(json.dumps([fixed, counters]))
"""


def test_repair_recognises_look_alike_copies_in_other_libraries() -> None:
    result = run_code(LOOKALIKE, "repair", prelude="scenarios")
    fixed, counters = json.loads(result.stdout)
    assert fixed == 1 and counters == [0, 0, 0]


def test_look_alike_control_leaks_without_repair() -> None:
    result = run_code(LOOKALIKE, "no", prelude="scenarios")
    _, counters = json.loads(result.stdout)
    assert counters[-1] > counters[0] > 0
