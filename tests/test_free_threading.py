"""Free-threaded CPython: no such interpreter can be had here, so the locked gate is untested there,
and ``status()`` says so on such a build.

Every interpreter this suite runs on has the GIL. A fresh one told that it has none
(``sys._is_gil_enabled`` replaced before the package is imported) takes the free-threaded path:
the gate's counter updates take a lock (which then really runs, under the GIL) and ``status()`` and
``bnb-gc-fix status`` carry a caution. The control is the same interpreter left as it is.

The lock is observed from outside: torch's parametrize module is given a class whose ``__setattr__``
runs when the gate writes the counter; at the gate's first write, another thread runs a forward of
another gated module. With the lock that thread waits until the first write is done; without it, it
runs through.
"""

from __future__ import annotations

import json

import pytest
from conftest import FIX, run_code

GIL_OFF = "import sys\nsys._is_gil_enabled = lambda: False\n"

GATE = """
import threading, types
import torch, quantized, bnb_gc_fix
import torch.nn.utils.parametrize as P
module, other = quantized.make(params=2), quantized.make(params=1)
quantized.interrupted_forward(module, torch.randn(2, 64))
module(torch.randn(2, 64))
healed = quantized.counter()

waited = []

class Watched(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "_cache_enabled" and not waited and threading.current_thread() is threading.main_thread():
            waited.append(None)  # the first write of the counter, inside the gate's pre-hook
            second = threading.Thread(target=other, args=(torch.randn(2, 64),))
            second.start()
            second.join(timeout=3)
            waited[0] = second.is_alive()  # still waiting for the first write to end: a lock
            threads.append(second)
        super().__setattr__(name, value)

threads = []
P.__class__ = Watched
module(torch.randn(2, 64))
threads[0].join()  # after the forward: the second thread may be waiting for the lock the first holds
P.__class__ = types.ModuleType
print(json.dumps([waited, healed, quantized.counter(), bnb_gc_fix.status().reason]))
"""

CLI = "from bnb_gc_fix.cli import main\nprint('STATUS')\nraise SystemExit(main(['status']))\n"


@pytest.mark.stack
@pytest.mark.parametrize("gil", [False, True], ids=["gil-off", "control-gil-on"])
def test_without_the_gil_the_locked_gate_runs_and_status_says_it_is_untested(gil: bool) -> None:
    # One interpreter: the gate, then `bnb-gc-fix status` (it runs under the fix's own switch there).
    result = run_code(("" if gil else GIL_OFF) + GATE + CLI, prelude="scenarios", switch=FIX)
    out = result.stdout.splitlines()
    waited, healed, counter, reason = json.loads(next(line for line in out if line.startswith("[")))
    assert healed == 0  # the Ctrl-C hold healed at the next forward, locked or not
    assert counter == 0  # both threads' forwards paired
    assert waited == [not gil]  # without the GIL, a second thread's update waits for the first's
    assert ("never tested" in reason) is not gil
    text = out[out.index("STATUS") + 1 :]
    assert ("  Caution: this Python runs without the GIL" in text[2]) is not gil
