"""A threaded process that forks while a thread is in the middle of a self-calling quantized forward.

    python tests/scenarios/forking.py

A serving thread runs a 4-bit module that calls itself. While its inner call runs (nested in the outer
one: the module keeps its one switch-on), the thread stops at every function of bnb-gc-fix it enters
(holding whatever that code holds at that instant: locks, references, an entry nested or not yet given
back) and once inside the inner forward's own body; at each stop the main thread forks a child.
Each child reports the counter it starts with, then runs a plain forward and a self-calling forward
of the same module, and reports the counter again; the parent waits at most 10 s for it. One JSON
line: ``{"children": [{"stop": ..., "at_fork": n, "after": n} or {"stop": ..., "hung": true}]}``.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quantized

PACKAGE = os.sep + "bnb_gc_fix" + os.sep
MAX_STOPS = 40


class SelfCalling(quantized.Quantized):
    def forward(self, x: Any, depth: int = 0) -> Any:  # type: ignore[override]
        out = super().forward(x)
        if depth == 0:
            inner.set()
            out = out + self(x, 1)
            inner.clear()
        elif stop_here is not None:
            stop_here("inside the inner forward")
        return out


inner = threading.Event()
stops: queue.Queue[str | None] = queue.Queue()
resume = threading.Semaphore(0)
stop_here: Any = None


def _stop(where: str) -> None:
    stops.put(where)
    resume.acquire()


def _tracer(frame: Any, event: str, arg: Any) -> Any:
    if event == "call" and inner.is_set() and PACKAGE in frame.f_code.co_filename:
        _stop(frame.f_code.co_name)
    return None


def serve() -> None:
    global stop_here
    stop_here = _stop
    sys.settrace(_tracer)
    try:
        module(x, 0)
    finally:
        sys.settrace(None)
        stop_here = None
        stops.put(None)


def child(where: str) -> None:
    global stop_here
    stop_here = None
    inner.clear()
    result: dict[str, Any] = {"stop": where, "at_fork": quantized.counter()}
    module(x)
    module(x, 0)
    result["after"] = quantized.counter()
    os.write(pipe_w, (json.dumps(result) + "\n").encode())
    os._exit(0)


def fork_at(where: str) -> dict[str, Any]:
    pid = os.fork()
    if pid == 0:
        child(where)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            line = b""
            while not line.endswith(b"\n"):
                line += os.read(pipe_r, 4096)
            return dict(json.loads(line))
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return {"stop": where, "hung": True}


torch.manual_seed(0)
torch.set_num_threads(1)
module = quantized.quantize(SelfCalling(params=1))
x = torch.randn(2, 64)
pipe_r, pipe_w = os.pipe()
children = []
server = threading.Thread(target=serve)
server.start()
while True:
    where = stops.get(timeout=60)
    if where is None:
        break
    if len(children) < MAX_STOPS:
        children.append(fork_at(where))
    resume.release()
server.join()
print(json.dumps({"children": children, "end": quantized.counter()}))
