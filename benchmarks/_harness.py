"""The benchmarks' shared harness (benchmarks/README.md, "How to read a ratio"). The scripts import it by
path: ``python benchmarks/<script>.py`` puts this folder first on ``sys.path``.
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
        """The JSON form: median, min, max (the keys the results always had), then q1, q3."""
        return {"median": self.median, "min": self.min, "max": self.max, "q1": self.q1, "q3": self.q3}

    def text(self) -> str:
        """``1.112x (1.105-1.118)``: the median and the interquartile range."""
        return f"{self.median:.3f}x ({self.q1:.3f}-{self.q3:.3f})"


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Per-round ratios of two sides timed in the same rounds."""
    return [top / bottom for top, bottom in zip(numerators, denominators)]


def verdict(ratio: Spread, floor: Spread | None) -> str:
    """What a ratio reads as: its median, or "no measurable difference" where it is not told apart from
    the noise floor (or, with no floor, from 1)."""
    within_noise = floor.contains(ratio.median) if floor is not None else ratio.contains(1.0)
    return NO_DIFFERENCE if within_noise else f"{ratio.median:.3f}x"


@dataclass(frozen=True)
class Comparison:
    """One side against the baseline: the per-round ratio, the noise floor beside it, the goal."""

    ratio: Spread
    floor: Spread | None
    goal: float | None = None

    @property
    def verdict(self) -> str:
        return verdict(self.ratio, self.floor)

    @property
    def met(self) -> bool | None:
        """Whether the median meets the goal (a ratio at most ``goal``); None with no goal."""
        return None if self.goal is None else self.ratio.median <= self.goal

    def record(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio.record(),
            "noise_floor": None if self.floor is None else self.floor.record(),
            "result": self.verdict,
            "goal": None if self.goal is None else f"<= {self.goal:.2f}",
            "met": self.met,
        }


def compare(
    side: list[float], baseline: list[float], floor: list[float] | None, goal: float | None = None
) -> Comparison:
    """``side`` and ``floor`` (a second baseline) against ``baseline``, round by round."""
    floor_spread = None if floor is None else Spread.of(ratios(floor, baseline))
    return Comparison(ratio=Spread.of(ratios(side, baseline)), floor=floor_spread, goal=goal)


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


def loop(call: Callable[[], Any], clock: Callable[[], int] = time.perf_counter_ns) -> Timed:
    """A timed block of ``n`` calls of ``call`` (wall time by default; ``time.process_time_ns`` for CPU)."""

    def timed(n: int) -> int:
        started = clock()
        for _ in range(n):
            call()
        return clock() - started

    return timed


def blocks(configs: dict[str, Timed], calls: int, rounds: int, baseline: str) -> dict[str, Any]:
    """Time a block of ``calls`` calls of every configuration per round, alternating, garbage collector off.

    The record: calls_per_block, rounds, baseline, the median and min ns per call of every configuration,
    every round's ns per call, and every other configuration's ratio to the baseline (``Spread.record``).
    """
    for timed in configs.values():  # warm up
        timed(max(calls // 10, 1))
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        elapsed = alternate({name: _per_call(timed, calls) for name, timed in configs.items()}, rounds)
    finally:
        if gc_was_enabled:
            gc.enable()
    ratio_spreads = {
        name: Spread.of(ratios(values, elapsed[baseline]))
        for name, values in elapsed.items()
        if name != baseline
    }
    return {
        "calls_per_block": calls,
        "rounds": rounds,
        "baseline": baseline,
        "median_ns_per_call": {name: median(values) for name, values in elapsed.items()},
        "min_ns_per_call": {name: min(values) for name, values in elapsed.items()},
        "ns_per_call_by_round": elapsed,
        "ratio_to_baseline": {name: spread.record() for name, spread in ratio_spreads.items()},
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


def message_of(line: str) -> dict[str, Any] | None:
    """The message a worker's stdout line carries, or None for any other line."""
    if not line.startswith(MARK):
        return None
    message: dict[str, Any] = json.loads(line[len(MARK) :])
    return message


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
        if isinstance(value, list | tuple):
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
            message = message_of(line)
            if message is not None:
                self.inbox.put(message)
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

    def received(self) -> list[dict[str, Any]]:
        """The messages that arrived since the last look, without waiting."""
        found = []
        while not self.inbox.empty():
            message = self.inbox.get()
            if message is not None:
                found.append(message)
        return found

    def close(self) -> None:
        """Ask it to quit (``{"cmd": "quit"}``); kill it if it has not within a minute."""
        if self.process.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


# --------------------------------------------------------------------------- machine facts


def machine() -> dict[str, Any]:
    """What the figures were measured on (every result JSON's ``machine``)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "processor": _cpu_model(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda_version"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["bitsandbytes"] = version("bitsandbytes")
        info["transformers"] = version("transformers")
    except Exception:
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
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {_shown(path)}", file=sys.stderr)


def write_results(output: Path, result: dict[str, Any], text: str) -> None:
    """A benchmark's result: JSON at ``output``, its Markdown beside it (``.md``), the Markdown printed."""
    write_json(output, result)
    write_text(output.with_suffix(".md"), text)
    print(text)


def table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> list[str]:
    """A Markdown table; the columns at the indices ``left`` are left-aligned, the others right-aligned."""
    rule = "|" + "|".join("---" if index in left else "---:" for index in range(len(header))) + "|"
    return [_row(header), rule, *(_row(row) for row in rows)]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"
