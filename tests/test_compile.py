"""torch.compile: the fix's hooks are traced with no graph break, and heal as in eager mode.

Each trigger once crashed an earlier version of the fix inside Dynamo while the control
(``BNB_GC_FIX=0``) ran. The rule for every hostile host: where the control runs, the fixed run runs too,
and ends no worse; here also with the same outputs. Every run is a fresh interpreter
(``tests/scenarios/compiled.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import AFFECTED, FIX, SCENARIOS, run_code, run_python

pytestmark = [pytest.mark.usefixtures("startup_hook_installed")]

SCENARIO = SCENARIOS / "compiled.py"


def _summaries(triggers: str, backend: str, switch: str | None, steps: int = 4) -> dict[str, Any]:
    result = run_python(
        [str(SCENARIO), "--trigger", triggers, "--backend", backend, "--steps", str(steps)],
        switch=switch,
        timeout=600,
    )
    assert result.returncode == 0, f"compiled scenario failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    summaries = [record["summary"] for record in result.records if "summary" in record]
    assert [s["trigger"] for s in summaries] == triggers.split(","), result.stderr[-2000:]
    return {s["trigger"]: s for s in summaries}


def _fix_and_control(triggers: str, backend: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _summaries(triggers, backend, FIX), _summaries(triggers, backend, "0")


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_programs_heal_like_eager_with_every_backend(backend: str) -> None:
    triggers = "loop,interrupt,error,selfcall" if backend != "aot_eager" else "interrupt,selfcall"
    fixed, control = _fix_and_control(triggers, backend)
    for trigger, run in fixed.items():
        assert run["errors"] == [] and control[trigger]["errors"] == []
        # Same outputs as the control: the fix changes nothing a forward computes.
        assert run["outputs"] == control[trigger]["outputs"], trigger
        assert run["cache_entries"] == 0, trigger
        assert run["state"] == ("protected" if AFFECTED else "not affected")
        # The fix's hooks are traced with no graph break of their own.
        assert run["graph_breaks"] == control[trigger]["graph_breaks"] == 0, trigger
    # A caught KeyboardInterrupt: the control stays stuck at 1; the fix heals at the next step.
    assert control["interrupt"]["counters"] == [0, 1, 1, 1]
    assert fixed["interrupt"]["counters"] == [0, 1, 0, 0]
    # What it left was switched on inside the trace: ticket ledger.COMPILED (-1), which no cell's end
    # switches off; the module's next forward does.
    assert fixed["interrupt"]["left"] == [[], [-1], [], []]
    # A module that calls itself (weight sharing): no interrupt, nothing to heal, nothing left.
    assert fixed["selfcall"]["counters"] == control["selfcall"]["counters"] == [0, 0, 0, 0]
    if "error" in fixed:
        # An Exception inside a compiled forward: the always-called hook releases it at once.
        assert control["error"]["counters"] == ([0, 1, 1, 1] if AFFECTED else [0, 0, 0, 0])
        assert fixed["error"]["counters"] == [0, 0, 0, 0]
    if "loop" in fixed:
        # An ordinary compiled training loop: no extra graph, no recompile against the control.
        assert fixed["loop"]["graphs"] == control["loop"]["graphs"] == 1
        assert fixed["loop"]["counters"] == control["loop"]["counters"] == [0, 0, 0, 0]


def test_compiled_model_served_from_two_threads_ends_no_worse_than_the_control() -> None:
    fixed, control = _fix_and_control("threads", "eager")
    # No forward was left early, so bitsandbytes' own pair (plain or always-called) gave back every
    # hold it took, at every step; each thread's holds are its own.
    assert control["threads"]["errors"] == [] and fixed["threads"]["errors"] == []
    assert fixed["threads"]["counters"] == control["threads"]["counters"] == [0, 0, 0, 0]
    assert fixed["threads"]["cache_entries"] == control["threads"]["cache_entries"] == 0
    assert fixed["threads"]["outputs"] == control["threads"]["outputs"]
    assert fixed["threads"]["graph_breaks"] == control["threads"]["graph_breaks"]  # the .tolist()'s own


FULLGRAPH_SELF_CALL = """
import torch
import quantized

class Recursive(quantized.Quantized):
    def forward(self, x, level=0):
        x = x @ self.w0.t()
        if level < 2:
            x = self(x, level + 1)  # a weight-shared layer applied again: a nested call of itself
        return x

torch.manual_seed(0)
module = quantized.quantize(Recursive(params=1))
compiled = torch.compile(module, fullgraph=True, backend="eager")
x = torch.randn(2, 64)
outputs = [round(float(compiled(x).sum()), 5) for _ in range(3)]
print(json.dumps({"outputs": outputs, "counter": quantized.counter()}))
"""


def test_a_module_calling_itself_compiles_with_fullgraph_where_the_control_does() -> None:
    # Inside a trace the fix's re-entry rule reads no frame (the earlier switch-on goes first, as before
    # calls of itself nested): nothing Dynamo cannot trace, no graph break, fullgraph=True compiles.
    fixed = run_code(FULLGRAPH_SELF_CALL, prelude="scenarios", switch=FIX).last_json
    control = run_code(FULLGRAPH_SELF_CALL, prelude="scenarios", switch="0").last_json
    assert fixed == control and fixed["counter"] == 0


# A Ctrl-C inside the inner call of a module calling itself (not caught inside it: the switch-on of its
# outer call stays, held by the inner call's entry), then a compiled forward of the module (its trace reads
# no frame and switches that switch-on off), then, inside a P.cached() block, a forward whose pre-hook
# ahead of bitsandbytes' raises (torch calls the always-called off hook only) and a plain forward. The
# counter after each, and after the block: the block's count is never taken.
CTRL_C_IN_A_SELF_CALL_THEN_COMPILED = """
import torch
import torch.nn.utils.parametrize as P
import quantized

class CallsItself(quantized.Quantized):
    def forward(self, x, depth=0, stop=False):
        out = super().forward(x)
        if depth == 0:
            out = out + self(x, 1, stop)
        elif stop:
            raise KeyboardInterrupt
        return out

def refuse(module, args):
    raise ValueError("a pre-hook ahead of bitsandbytes' refuses")

torch.manual_seed(0)
module = quantized.quantize(CallsItself(params=1))
compiled = torch.compile(module, backend="eager")
x = torch.randn(2, 64)
seen = []
try:
    module(x, 0, True)
except KeyboardInterrupt:
    pass
seen.append(quantized.counter())
compiled(x, 1)
seen.append(quantized.counter())
with P.cached():
    handle = module.register_forward_pre_hook(refuse, prepend=True)
    try:
        module(x, 1)
    except ValueError:
        pass
    handle.remove()
    module(x, 1)
    seen.append(quantized.counter())
seen.append(quantized.counter())
print(json.dumps(seen))
"""


def test_a_ctrl_c_left_in_a_self_call_then_a_compiled_forward_never_takes_a_p_cached_blocks_count() -> None:
    fixed = run_code(CTRL_C_IN_A_SELF_CALL_THEN_COMPILED, prelude="scenarios", switch=FIX).last_json
    control = run_code(CTRL_C_IN_A_SELF_CALL_THEN_COMPILED, prelude="scenarios", switch="0").last_json
    if AFFECTED:  # bitsandbytes 0.48-0.49's plain pair: each Ctrl-C'd call's +1 stays, never below
        assert control == [2, 2, 3, 2]
    # The compiled forward switches off what the Ctrl-C left, and forgets it: the block keeps its 1.
    assert fixed == [1, 0, 1, 0]  # 7d986c2: [1, 0, 0, -1], the block's count taken, the cache left on
