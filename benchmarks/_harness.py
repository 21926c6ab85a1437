"""The benchmarks' one harness (benchmarks/README.md, "How to read a ratio"): alternating rounds and what
their ratios read as, worker processes, the configurations of the memory benchmarks, a training step, and
the result files. The scripts import it by path: ``python benchmarks/<script>.py`` puts this folder first
on ``sys.path``.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
RAW = RESULTS / "tmp"  # git-ignored: raw runs, and every quick run
NO_DIFFERENCE = "no measurable difference"

T = TypeVar("T")
Timed = Callable[[int], int]  # runs n calls, returns the time they took in ns


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's argument parser, its module docstring as the description."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def is_cuda(device: object) -> bool:
    return str(device).startswith("cuda")


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Spread:
    """The median of some values and their interquartile range (q1-q3)."""

    median: float
    q1: float
    q3: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if len(values) > 1:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        else:
            q1 = q3 = values[0]
        return cls(median=float(statistics.median(values)), q1=q1, q3=q3)

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside the interquartile range."""
        return self.q1 <= value <= self.q3

    def record(self) -> dict[str, float]:
        return asdict(self)

    def text(self, unit: str = "x", digits: int = 3, scale: float = 1.0) -> str:
        """``1.112x (1.105 to 1.118)``: the median and the interquartile range, each divided by ``scale``."""
        low, middle, high = self.q1 / scale, self.median / scale, self.q3 / scale
        return f"{middle:.{digits}f}{unit} ({low:.{digits}f} to {high:.{digits}f})"


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


def _per_call(timed: Timed, calls: int) -> float:
    return timed(calls) / calls


def blocks(configs: dict[str, Timed], calls: int, rounds: int) -> dict[str, list[float]]:
    """Every configuration's ns per call in blocks of ``calls`` calls, one block a round, alternating, the
    garbage collector off; by configuration, one value a round."""
    for timed in configs.values():  # warm up
        timed(max(calls // 10, 1))
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return alternate({name: partial(_per_call, timed, calls) for name, timed in configs.items()}, rounds)
    finally:
        if gc_was_enabled:
            gc.enable()


# --------------------------------------------------------------------------- worker processes

MARK = "@@"  # a worker's stdout line that carries a message starts with it (the rest is the worker's own)


def emit(message: dict[str, Any]) -> None:
    """Send one JSON message to the driver, on stdout."""
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def worker_command(script: Path, options: dict[str, Any]) -> list[str]:
    """``python script --option value ...``: True gives the flag alone, False or None leaves it out."""
    command = [sys.executable, str(script)]
    for name, value in options.items():
        if value is None or value is False:
            continue
        command.append("--" + name.replace("_", "-"))
        if value is not True:
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
        threading.Thread(target=self._read, daemon=True).start()

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
        """Close its stdin (a worker ends there); kill it if it has not ended within a minute."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()


# --------------------------------------------------------------------------- the configurations

UNFIXED = "unfixed"  # bitsandbytes 0.49.2 as installed, BNB_GC_FIX=0
PACKAGE = "bnb-gc-fix"  # the same, and `import bnb_gc_fix`
UPSTREAM = "upstream-0.50"  # BNB_GC_FIX=0, bitsandbytes 0.50's pairs put into 0.49.2 by the benchmark
WORKAROUND = "workaround"  # BNB_GC_FIX=0, the report's workaround: the experts' bare forward checkpointed


def config_env(config: str) -> dict[str, str]:
    """The environment of a fresh worker running ``config``: all but the package's switch its start-up
    hook off (it would turn the fix on in every process of a venv it is installed in)."""
    env = dict(os.environ)
    env.pop("BNB_GC_FIX", None)
    if config != PACKAGE:
        env["BNB_GC_FIX"] = "0"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # bitsandbytes' CPU backend, at every quantization
    return env


#: bitsandbytes 0.50.2's two hooks, verbatim but for comments and annotations.
UPSTREAM_HOOKS = """
def _enable_parametrization_cache(module, inputs):
    P._cache_enabled += 1

def _disable_parametrization_cache(module, inputs, output):
    P._cache_enabled = max(0, P._cache_enabled - 1)
    if not P._cache_enabled:
        P._cache = {}
"""


#: bitsandbytes 0.49.2's two hooks (the leaking pair), verbatim but for comments and annotations.
PLAIN_HOOKS = """
def _disable_parametrization_cache(module, inputs, output):
    P._cache_enabled -= 1
    if not P._cache_enabled:
        P._cache = {}

def _enable_parametrization_cache(module, inputs):
    P._cache_enabled += 1
"""


def plain_register() -> Callable[[Any, str], None]:
    """bitsandbytes 0.49.2's own pair, as a fresh copy of its module would register it: its two hooks
    (``PLAIN_HOOKS``, compiled in the installed module's namespace, functions the fix never sees, so it is
    not in them), the disable hook plain."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    hooks: dict[str, Any] = {}
    exec(PLAIN_HOOKS, vars(bnb_parametrize), hooks)
    enable = hooks["_enable_parametrization_cache"]
    disable = hooks["_disable_parametrization_cache"]

    def _register_parametrization_hooks(module: Any, param_name: str) -> None:
        module.register_forward_pre_hook(enable)
        module.register_forward_hook(disable)

    return _register_parametrization_hooks


def upstream_register() -> Callable[[Any, str], None]:
    """bitsandbytes 0.50's ``_register_parametrization_hooks`` on the installed bitsandbytes: its two hooks
    (``UPSTREAM_HOOKS``, compiled in the installed module's namespace, so they read ``P`` as 0.50's do), the
    disable hook always called, beside the installed state dict hook. Every module it registers on gets the
    same two functions, as in 0.50."""
    import bitsandbytes.nn.parametrize as bnb_parametrize

    hooks: dict[str, Any] = {}
    exec(UPSTREAM_HOOKS, vars(bnb_parametrize), hooks)
    enable = hooks["_enable_parametrization_cache"]
    disable = hooks["_disable_parametrization_cache"]
    state_dict_hook = bnb_parametrize._parametrized_state_dict_post_hook

    def _register_parametrization_hooks(module: Any, param_name: str) -> None:
        module.register_state_dict_post_hook(partial(state_dict_hook, param_name=param_name))
        module.register_forward_pre_hook(enable)
        module.register_forward_hook(disable, always_call=True)

    return _register_parametrization_hooks


def start(config: str, threads: int | None) -> None:
    """A worker's first act: the configuration's fix (the package's import, or upstream's hooks)."""
    if config == PACKAGE:
        import bnb_gc_fix  # noqa: F401  (the import turns the fix on)
    import torch

    if threads:
        torch.set_num_threads(threads)
    if config == UPSTREAM:
        import bitsandbytes.nn.parametrize as bnb_parametrize

        bnb_parametrize._register_parametrization_hooks = upstream_register()


def checkpoint_experts_by_hand(model: Any) -> None:
    """The report's workaround: every experts module's bare forward (its ``forward``, not the module call
    that runs bitsandbytes' hooks) inside a non-reentrant ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.forward = partial(checkpoint, experts.forward, use_reentrant=False)


def fix_state(config: str) -> dict[str, Any]:
    """Evidence that a worker runs the configuration it claims to (SystemExit where it does not): with the
    package, its status protected and the package imported from this checkout; without, never imported."""
    imported = sys.modules.get("bnb_gc_fix")
    if config != PACKAGE:
        if imported is not None:
            raise SystemExit(f"bnb_gc_fix was imported in the {config} worker (is BNB_GC_FIX=0 set?)")
        return {"bnb_gc_fix_imported": False}
    status = imported.status() if imported is not None else None
    if status is None or status.state != "protected":
        raise SystemExit(f"bnb-gc-fix does not protect the {config} worker: {status}")
    return {"bnb_gc_fix_imported": True, "from": imported.__file__, "state": status.state}


# --------------------------------------------------------------------------- training


def trainer(model: Any, lr: float, batch: int, seq: int, device: str) -> tuple[Any, Any]:
    """The report's loop around ``model``: AdamW over its trainable parameters, fixed random input ids."""
    import torch

    model.config.use_cache = False
    model.train()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
    return optimizer, ids


def train_step(model: Any, ids: Any, optimizer: Any, cuda: bool) -> dict[str, Any]:
    """One training step, timed, and what it left behind in torch's cache (and CUDA's memory)."""
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
    record: dict[str, Any] = {"step_s": time.perf_counter() - started, "loss": float(loss.item())}
    record.update(cache_state())
    if cuda:
        record["allocated_bytes"] = torch.cuda.memory_allocated()
        record["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return record


def cache_state() -> dict[str, int]:
    """torch's parametrization cache right now: its counter, entries, and bytes held by its tensors."""
    import torch
    import torch.nn.utils.parametrize as P

    tensors = [value for value in list(P._cache.values()) if isinstance(value, torch.Tensor)]
    held = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return {"counter": int(P._cache_enabled), "cache_entries": len(P._cache), "cache_bytes": held}


# --------------------------------------------------------------------------- machine facts and results


def machine() -> dict[str, Any]:
    """What the figures were measured on, with the load average as called."""
    from importlib.metadata import version

    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "bitsandbytes": version("bitsandbytes"),
        "transformers": version("transformers"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict[str, Any]) -> str:
    """The machine facts as the last line of a result."""
    where = info.get("gpu") or f"{info['cpus']} CPUs, no GPU"
    return (
        f"Measured on {where}: CPython {info['python']}, torch {info['torch']}, bitsandbytes "
        f"{info['bitsandbytes']}, transformers {info['transformers']}; load average {info['load']:.2f} at "
        "the start."
    )


def write_results(name: str, result: dict[str, Any], text: str, quick: bool, output: Path | None) -> None:
    """A run's raw JSON (``output``, else results/tmp/NAME.json) and its Markdown, the result a reader
    opens: results/NAME.md, or beside the JSON for a quick run or a chosen ``output``."""
    raw = output or RAW / f"{name}.json"
    shown = raw.with_suffix(".md") if quick or output else RESULTS / f"{name}.md"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(result, indent=2) + "\n")
    shown.write_text(text)
    print(text)
    print(f"wrote {shown} (raw: {raw})", file=sys.stderr)


def page(preamble: str, header: list[str], rows: list[list[str]], machine: dict[str, Any]) -> str:
    """A result's Markdown: a line on how to read it, its table, and the machine it was measured on."""
    return "\n".join([preamble, "", *table(header, rows), "", machine_line(machine)]) + "\n"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, its first column left-aligned, the others right-aligned."""
    rule = "|---|" + "---:|" * (len(header) - 1)
    return [_row(header), rule, *(_row(row) for row in rows)]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def mib(value: float) -> str:
    return f"{value / 2**20:.1f} MiB"
