"""Free-threaded CPython: no such interpreter can be had here, so the locked gate is untested there,
and ``status()`` says so on such a build.

Every interpreter this suite runs on has the GIL. A fresh one told that it has none
(``sys._is_gil_enabled`` replaced before the package is imported) takes the free-threaded path:
the locked gate (which then really runs, under the GIL) and the caution in ``status()`` and
``bnb-gc-fix status``. The control is the same interpreter left as it is.
"""

from __future__ import annotations

import json

import pytest
from conftest import FIX, SCENARIOS, run_code

GIL_OFF = "import sys\nsys._is_gil_enabled = lambda: False\n"

GATE = f"""
import sys, json; sys.path.insert(0, {str(SCENARIOS)!r})
import torch, quantized, bnb_gc_fix
from bnb_gc_fix.gate import gate_of
module = quantized.make(params=2)
quantized.interrupted_forward(module, torch.randn(2, 64))
module(torch.randn(2, 64))
print(json.dumps([type(gate_of(module)).__name__, quantized.counter(), bnb_gc_fix.status().reason]))
"""

CLI = "from bnb_gc_fix.cli import main\nprint('STATUS')\nraise SystemExit(main(['status']))\n"


@pytest.mark.stack
@pytest.mark.parametrize("gil", [False, True], ids=["gil-off", "control-gil-on"])
def test_without_the_gil_the_locked_gate_runs_and_status_says_it_is_untested(gil: bool) -> None:
    # One interpreter: the gate, then `bnb-gc-fix status` (it runs under the fix's own switch there).
    out = run_code(("" if gil else GIL_OFF) + GATE + CLI, switch=FIX).stdout.splitlines()
    name, counter, reason = json.loads(next(line for line in out if line.startswith("[")))
    assert counter == 0  # the Ctrl-C hold healed at the next forward, locked or not
    assert name == ("Gate" if gil else "_LockedGate")
    assert ("never tested" in reason) is not gil
    text = out[out.index("STATUS") + 1 :]
    assert ("  Caution: this Python runs without the GIL" in text[2]) is not gil
