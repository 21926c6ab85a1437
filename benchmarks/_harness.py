"""The benchmarks' one harness (benchmarks/README.md, "How to read a ratio"): alternating rounds and what
their ratios read as, worker processes, the three configurations of the memory benchmarks (bitsandbytes
0.50's pairs among them), a training step and what it leaves, machine facts and the result files. The
scripts import it by path: ``python benchmarks/<script>.py`` puts this folder first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOCS = ROOT / "docs"
NO_DIFFERENCE = "no measurable difference"

T = TypeVar("T")
Timed = Callable[[int], int]  # runs n calls, returns the time they took in ns


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's argument parser, its module docstring as the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def is_cuda(device: object) -> bool:
    return str(device).startswith("cuda")


# --------------------------------------------------------------------------- statistics


def median(values: list[float]) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Spread:
    """The median of some per-round values and their interquartile range (q1-q3), min and max."""

    median: float
    q1: float
    q3: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if len(values) > 1:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        else:
            q1 = q3 = values[0]
        return cls(median=median(values), q1=q1, q3=q3, min=min(values), max=max(values))

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside the interquartile range."""
        return self.q1 <= value <= self.q3

    def record(self) -> dict[str, float]:
        return {"median": self.median, "q1": self.q1, "q3": self.q3, "min": self.min, "max": self.max}

    def text(self, unit: str = "x", digits: int = 3) -> str:
        """``1.112x (1.105-1.118)``: the median and the interquartile range."""
        return f"{self.median:.{digits}f}{unit} ({self.q1:.{digits}f} to {self.q3:.{digits}f}{unit})"


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Per-round ratios of two sides timed in the same rounds."""
    return [top / bottom for top, bottom in zip(numerators, denominators)]


def verdict(ratio: Spread, floor: Spread | None) -> str:
    """What a ratio reads as: its median, or "no measurable difference" where it is not told apart from
    the noise floor (its median inside the floor's interquartile range; with no floor, 1 inside its own)."""
    within_noise = floor.contains(ratio.median) if floor is not None else ratio.contains(1.0)
    return NO_DIFFERENCE if within_noise else f"{ratio.median:.3f}x"


def compare(side: list[float], baseline: list[float], floor: list[float]) -> dict[str, Any]:
    """``side`` and ``floor`` (a second, identical baseline) against ``baseline``, round by round: both
    ratios' spreads and what the side's reads as."""
    ratio = Spread.of(ratios(side, baseline))
    noise = Spread.of(ratios(floor, baseline))
    return {"ratio": ratio.record(), "noise_floor": noise.record(), "result": verdict(ratio, noise)}


# --------------------------------------------------------------------------- alternating rounds


def order_of(names: list[str], index: int) -> list[str]:
    """Round ``index``'s order: as given in even rounds, reversed in odd ones."""
    return names if index % 2 == 0 else list(reversed(names))


def alternate(sides: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Run every side once a round, in an order that alternates every round; what each returned, by side."""
    names = list(sides)
    found: dict[str, list[T]] = {name: [] for name in names}
    for index in range(rounds):
        for name in order_of(names, index):
            found[name].append(sides[name]())
    return found


def loop(call: Callable[[], Any]) -> Timed:
    """A timed block of ``n`` calls of ``call`` (wall time)."""

    def timed(n: int) -> int:
        started = time.perf_counter_ns()
        for _ in range(n):
            call()
        return time.perf_counter_ns() - started

    return timed


def blocks(configs: dict[str, Timed], calls: int, rounds: int, baseline: str) -> dict[str, Any]:
    """Time a block of ``calls`` calls of every configuration per round, alternating, garbage collector off.
    The record: the block size and rounds, every round's ns per call, and the median ns per call."""
    for timed in configs.values():  # warm up
        timed(max(calls // 10, 1))
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        elapsed = alternate({name: _per_call(timed, calls) for name, timed in configs.items()}, rounds)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "calls_per_block": calls,
        "rounds": rounds,
        "baseline": baseline,
        "median_ns_per_call": {name: median(values) for name, values in elapsed.items()},
        "ns_per_call_by_round": elapsed,
    }


def _per_call(timed: Timed, calls: int) -> Callable[[], float]:
    def block() -> float:
        return timed(calls) / calls

    return block


# --------------------------------------------------------------------------- worker processes

MARK = "@@"  # a worker's stdout line that carries a message starts with it (the rest is the worker's own)


def emit(message: dict[str, Any]) -> None:
    """Send one JSON message to the driver, on stdout."""
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def commands() -> Iterator[dict[str, Any]]:
    """A worker's side: the driver's commands (``Worker.send``), one JSON line each on stdin."""
    for line in sys.stdin:
        yield json.loads(line)


def worker_command(script: Path, options: dict[str, Any]) -> list[str]:
    """``python script --option value ...``: True gives the flag alone, False or None leaves it out, and a
    list gives its values one after the other."""
    command = [sys.executable, str(script)]
    for name, value in options.items():
        if value is None or value is False:
            continue
        command.append("--" + name.replace("_", "-"))
        if isinstance(value, (list, tuple)):
            command += [str(item) for item in value]
        elif value is not True:
            command.append(str(value))
    return command


class Worker:
    """A fresh interpreter running ``command`` from the repository root; a thread reads its messages."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                self.inbox.put(json.loads(line[len(MARK) :]))
        self.inbox.put(None)  # its stdout closed

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict[str, Any]:
        """The next message, waiting for it; SystemExit if the worker ended first."""
        message = self.inbox.get()
        if message is None:
            code = self.process.wait()
            raise SystemExit(f"the {self.name} worker exited with status {code} (its stderr is above)")
        return message

    def close(self) -> None:
        """Ask it to quit (``{"cmd": "quit"}``); kill it if it has not within a minute."""
        if self.process.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


# --------------------------------------------------------------------------- the configurations

#: The memory benchmarks' configurations, in the order they are reported.
UNFIXED = "unfixed"
PACKAGE = "bnb-gc-fix"
UPSTREAM = "upstream-0.50"
CONFIGS = (UNFIXED, PACKAGE, UPSTREAM)
DESCRIPTIONS = {
    UNFIXED: "bitsandbytes as installed, BNB_GC_FIX=0",
    PACKAGE: "bitsandbytes as installed + import bnb_gc_fix",
    UPSTREAM: "bitsandbytes as installed, BNB_GC_FIX=0, upstream 0.50's hooks patched in by the benchmark",
}


def config_env(config: str) -> dict[str, str]:
    """The environment of a fresh worker running ``config``: the two without the package switch its
    start-up hook off (it would turn the fix on in every process of a venv it is installed in)."""
    env = dict(os.environ)
    env.pop("BNB_GC_FIX", None)
    if config != PACKAGE:
        env["BNB_GC_FIX"] = "0"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # bitsandbytes' CPU backend, at every quantization
    return env


#: bitsandbytes 0.50.2's disable hook, verbatim but for its comment and annotations.
UPSTREAM_DISABLE = """
def _disable_parametrization_cache(module, inputs, output):
    P._cache_enabled = max(0, P._cache_enabled - 1)
    if not P._cache_enabled:
        P._cache = {}
"""


def copy_of(function: Any) -> types.FunctionType:
    """A new function object with ``function``'s own code, globals, defaults and closure, so that the
    fix, which swaps the code of bitsandbytes' functions, never reaches it; taken before the fix is in."""
    code = function.__code__
    if code.co_filename != function.__globals__.get("__file__"):
        raise RuntimeError(f"{function.__qualname__} runs code from {code.co_filename}: copy it earlier")
    return types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)


def register_with(enable: Any, disable: Any, always_call: bool) -> Callable[..., None]:
    """A ``_register_parametrization_hooks`` registering ``enable`` and ``disable`` (``always_call`` as
    0.50 does, or plain as 0.48-0.49 do) beside the installed bitsandbytes' state dict hook."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    state_dict_hook = bnb_parametrize._parametrized_state_dict_post_hook

    def _register_parametrization_hooks(module: Any, param_name: str) -> None:
        module.register_state_dict_post_hook(functools.partial(state_dict_hook, param_name=param_name))
        module.register_forward_pre_hook(enable)
        module.register_forward_hook(disable, always_call=always_call)

    return _register_parametrization_hooks


@functools.cache
def upstream_hooks() -> tuple[Callable[..., None], Callable[..., None]]:
    """Upstream 0.50's ``(_register_parametrization_hooks, _disable_parametrization_cache)`` on the installed
    bitsandbytes: its disable hook (``UPSTREAM_DISABLE``, compiled in the installed module's namespace, so it
    reads ``P`` as 0.50's does), registered always-called after a copy of the installed enable hook (the
    same code in 0.48-0.50). Made once: every module gets the same two functions, as in 0.50."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    defined: dict[str, Any] = {}
    exec(UPSTREAM_DISABLE, vars(bnb_parametrize), defined)
    disable: Callable[..., None] = defined["_disable_parametrization_cache"]
    enable = copy_of(bnb_parametrize._enable_parametrization_cache)
    return register_with(enable, disable, always_call=True), disable


def start(config: str, threads: int | None) -> None:
    """A worker's first act: the configuration's fix (the package's import, or upstream's hooks)."""
    if config == PACKAGE:
        import bnb_gc_fix  # noqa: F401  (the import turns the fix on)
    import torch

    if threads:
        torch.set_num_threads(threads)
    if config == UPSTREAM:
        import bitsandbytes.nn.parametrize as bnb_parametrize

        register, disable = upstream_hooks()
        bnb_parametrize._disable_parametrization_cache = disable
        bnb_parametrize._register_parametrization_hooks = register


def fix_state(config: str) -> dict[str, Any]:
    """Evidence that a worker runs the configuration it claims to (SystemExit where it does not): with the
    package, its status protected; without, the package never imported."""
    imported = "bnb_gc_fix" in sys.modules
    state: dict[str, Any] = {"bnb_gc_fix_imported": imported}
    if imported:
        status = sys.modules["bnb_gc_fix"].status()
        state.update(state=status.state, reason=status.reason, covered=status.covered)
    if config == PACKAGE and state.get("state") != "protected":
        raise SystemExit(f"bnb-gc-fix does not protect the {config} worker: {state}")
    if config != PACKAGE and imported:
        raise SystemExit(f"bnb_gc_fix was imported in the {config} worker (is BNB_GC_FIX=0 set?)")
    return state


# --------------------------------------------------------------------------- training


def trainer(model: Any, lr: float, batch: int, seq: int, device: str) -> tuple[Any, Any, list[Any]]:
    """The report's loop around ``model``: (AdamW over its trainable parameters, fixed random input ids,
    those parameters)."""
    import torch

    model.config.use_cache = False
    model.train()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
    return optimizer, ids, trainable


def train_step(model: Any, ids: Any, optimizer: Any, step: int, cuda: bool) -> dict[str, Any]:
    """One training step, timed, and what it left behind: torch's cache, resident memory (and CUDA's)."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    counter, entries, cached = cache_state()
    status = proc_status()
    record: dict[str, Any] = {
        "step": step,
        "step_s": elapsed,
        "loss": float(loss.item()),
        "counter": counter,
        "cache_entries": entries,
        "cache_bytes": cached,
        "rss_bytes": status.get("VmRSS"),
        "peak_rss_bytes": status.get("VmHWM"),
    }
    if cuda:
        record["allocated_bytes"] = torch.cuda.memory_allocated()
        record["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return record


def cache_state() -> tuple[int, int, int]:
    """torch's parametrization cache right now: (counter, entries, bytes held by its tensors)."""
    import torch
    import torch.nn.utils.parametrize as P

    held = 0
    for tensor in list(P._cache.values()):
        if isinstance(tensor, torch.Tensor):
            held += tensor.numel() * tensor.element_size()
    return int(P._cache_enabled), len(P._cache), held


def proc_status() -> dict[str, int]:
    """This process's VmRSS and VmHWM (/proc/self/status, in bytes); empty where there is no /proc."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status") as fields:
            for line in fields:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


# --------------------------------------------------------------------------- machine facts


def machine() -> dict[str, Any]:
    """What the figures were measured on (every result JSON's ``machine``), the load average as called."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for name in ("bitsandbytes", "transformers"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# --------------------------------------------------------------------------- results


def output_path(name: str, quick: bool, chosen: Path | None = None) -> Path:
    """``chosen``, else ``results/<name>``, or ``results/tmp/<name>`` for a quick run (not a result)."""
    if chosen is not None:
        return chosen
    return (RESULTS / "tmp" if quick else RESULTS) / name


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_results(output: Path, result: dict[str, Any], text: str) -> None:
    """A benchmark's result: JSON at ``output``, its Markdown beside it (``.md``), the Markdown printed."""
    write_json(output, result)
    output.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {output} and its .md", file=sys.stderr)


def table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """A Markdown table; the columns at the indices ``left`` are left-aligned, the others right-aligned."""
    rule = "|" + "|".join("---" if index in left else "---:" for index in range(len(header))) + "|"
    return [_row(header), rule, *(_row(row) for row in rows)]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"
