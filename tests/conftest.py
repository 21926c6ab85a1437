"""Shared helpers: every scenario runs in a process of its own, forked from a warm parent or a fresh
interpreter, so global state never leaks between tests."""

from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import venv
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Literal

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
#: The checkout whose package the scenarios run: this one, or BNB_GC_FIX_TEST_AGAINST's (docs/development.md).
UNDER_TEST = Path(os.environ.get("BNB_GC_FIX_TEST_AGAINST") or ROOT)
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
TINY_OLMOE = SCENARIOS / "tiny_olmoe.py"


def installed(distribution: str) -> str | None:
    """The installed version of ``distribution`` (what the children will import), or None."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _affected_range() -> tuple[str, str]:
    """bitsandbytes' affected range as the package under test states it (``bnb_gc_fix.libraries``, its
    one place), read in a fresh interpreter: importing the package here would activate the fix in pytest."""
    code = (  # bnb_gc_fix.libraries; _bnb_gc_fix in a checkout from before it (BNB_GC_FIX_TEST_AGAINST)
        "try:\n    from bnb_gc_fix.libraries import BITSANDBYTES as B\n"
        "except ImportError:\n    from _bnb_gc_fix import BITSANDBYTES as B\n"
        "print(B.first_affected, B.first_fixed)\n"
    )
    against = os.environ.get("BNB_GC_FIX_TEST_AGAINST")
    env = {k: v for k, v in os.environ.items() if k not in ("BNB_GC_FIX", "PYTHONPATH")}
    env["BNB_GC_FIX"] = "0"  # nothing to activate: only the range is read
    if against:
        env["PYTHONPATH"] = against
    completed = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=against or ROOT.parent,  # not the repo root: the installed package (a wheel cell's) answers
    )
    words = completed.stdout.split()
    if completed.returncode != 0 or len(words) != 2:
        raise RuntimeError(f"cannot read the affected range from _bnb_gc_fix:\n{completed.stderr}")
    return words[0], words[1]


# Expectations come from the stack the tests run on (the nox cells of cells.toml run the `stack` tests on
# several) and from the package's own statement of the affected range, never from hard-coded versions.
BITSANDBYTES = installed("bitsandbytes")
TORCH = installed("torch")
TRANSFORMERS = installed("transformers")
FIRST_AFFECTED, FIRST_FIXED = _affected_range()
# An affected bitsandbytes leaks without the fix and is patched in auto mode; a fixed one (upstream's
# fix) does not leak under checkpointing, the package steps aside, and `force` patches it anyway.
AFFECTED = BITSANDBYTES is not None and Version(FIRST_AFFECTED) <= Version(
    Version(BITSANDBYTES).base_version
) < Version(FIRST_FIXED)
FIX = None if AFFECTED else "force"  # the switch under which the package gates the hooks here

# One intra-op thread per torch process unless the caller chose: the scenarios are tiny, and on a 2-core
# machine two pytest workers each running a child with torch's default thread pool oversubscribe the cores
# (the README's command measured 5 min 22 s with torch's default, 3 min 51 s with 1). Children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Noise that torch and bitsandbytes print on CPU-only machines; never ours.
_FOREIGN_STDERR = ("kernels", "FutureWarning", "_check_is_size", "torch._check", "eos_token_id")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def records(self) -> list[dict[str, Any]]:
        """JSON objects printed one per line (other lines ignored)."""
        out = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a library's own printout (Trainer prints dicts)
                    continue
        return out

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "step" in r]

    @property
    def summary(self) -> dict[str, Any]:
        return next(r["summary"] for r in self.records if "summary" in r)

    @property
    def last_line(self) -> str:
        """The last line the child printed (a snippet prints its result last)."""
        lines = self.stdout.rstrip().splitlines()
        assert lines, f"the child printed nothing:\n{self.stderr}"
        return lines[-1]

    @property
    def last_json(self) -> Any:
        """The last line the child printed, parsed as JSON."""
        return json.loads(self.last_line)

    @property
    def our_stderr(self) -> str:
        """stderr without the lines torch/bitsandbytes print on their own."""
        return "\n".join(
            line
            for line in self.stderr.splitlines()
            if line.strip() and not any(n in line for n in _FOREIGN_STDERR)
        )


def unwrapped(text: str) -> str:
    """What the package printed, its wrapped lines joined: each run of whitespace one space."""
    return " ".join(text.split())


def environment(switch: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BNB_GC_FIX"}
    env.pop("PYTHONPATH", None)
    against = os.environ.get("BNB_GC_FIX_TEST_AGAINST")
    if against:  # another checkout's package and start-up hook, to show a test failing there
        env["PYTHONPATH"] = against
    if switch is not None:
        env["BNB_GC_FIX"] = switch
    if against and "PYTHONPATH" in extra:  # other releases first, and still that checkout's package
        extra = {**extra, "PYTHONPATH": os.pathsep.join([extra["PYTHONPATH"], against])}
    env.update(extra)
    return env


# --- where a scenario runs ---------------------------------------------------------------------------
# Every scenario runs in a process of its own whose global state is pristine. By default that process is
# forked from a warm parent (tests/warm_parent.py: torch, bitsandbytes and transformers imported once per
# test worker, the package not). A scenario that only a fresh interpreter can show (interpreter start,
# import order, Python's options, another executable or PYTHONPATH) runs in one, and says why:
# run_python(..., fresh="why").

WARM_PARENT = Path(__file__).resolve().parent / "warm_parent.py"


def _read_by_the_scenario(name: str) -> bool:
    """The variables a warm child reads only once it is the scenario (the start-up hook and the package
    read BNB_GC_FIX there; pytest sets PYTEST_CURRENT_TEST anew for each test): any other may have been
    read as the parent started or imported its libraries, so a scenario that sets it otherwise than the
    parent's environment needs a fresh interpreter."""
    return name in ("BNB_GC_FIX", "PYTEST_CURRENT_TEST") or name.startswith("BNB_GC_FIX_")


class WarmParent:
    """This test worker's warm parent, started at its first scenario and ended with the worker."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.folder = Path(tempfile.mkdtemp(prefix="bnb-gc-fix-warm-"))
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        self.log = open(self.folder / "parent.log", "w")  # open as long as the parent runs
        self.process = subprocess.Popen(
            [sys.executable, str(WARM_PARENT), str(requests_read), str(replies_write)],
            pass_fds=(requests_read, replies_write),
            env=env,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        os.close(requests_read)
        os.close(replies_write)
        self.requests = os.fdopen(requests_write, "w", buffering=1)
        self.replies = replies_read
        self.pending = b""
        self.scenarios = 0
        self.unusable: str | None = None  # why this parent cannot serve: then every scenario runs fresh

    def differs_at_start(self, env: dict[str, str]) -> list[str]:
        """The variables that ``env`` sets otherwise than this parent's environment, where the parent may
        have read them already."""
        names = set(env) | set(self.env)
        differ = [name for name in names if env.get(name) != self.env.get(name)]
        return sorted(name for name in differ if not _read_by_the_scenario(name))

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        """The parent's next reply, or None when ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                return None
            chunk = os.read(self.replies, 65536)
            if not chunk:
                raise RuntimeError(f"the warm parent ended:\n{(self.folder / 'parent.log').read_text()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, argv: list[str], env: dict[str, str], cwd: Path | str, timeout: float) -> Run | None:
        """The scenario's run, or None where this parent cannot be pristine (a library release that
        imports bitsandbytes' 4-bit module by itself): then it runs in a fresh interpreter."""
        if self.unusable is not None:
            return None
        self.scenarios += 1
        out = self.folder / f"{self.scenarios}.out"
        err = self.folder / f"{self.scenarios}.err"
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.requests.write(json.dumps(request) + "\n")
        started = self._reply(timeout=600)  # the parent's own start, at the first scenario
        if started is None:
            raise RuntimeError(f"the warm parent did not answer:\n{(self.folder / 'parent.log').read_text()}")
        if "error" in started:
            self.unusable = started["error"]
            return None
        ended = self._reply(timeout)
        if ended is None:
            os.killpg(started["pid"], signal.SIGKILL)
            self._reply(timeout=60)
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
        return Run(ended["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        self.requests.close()
        self.process.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_warm: list[WarmParent] = []


def warm_parent() -> WarmParent:
    """This worker's warm parent, started with the environment a scenario gets by default (the switch
    off: its start-up hook does nothing)."""
    if not _warm:
        _warm.append(WarmParent(environment("0")))
        atexit.register(_warm[0].close)
    return _warm[0]


def run_python(
    args: list[str],
    switch: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path | None = None,
    executable: str = sys.executable,
    fresh: str | None = None,
) -> Run:
    """Run ``python ARGS`` in a process of its own with BNB_GC_FIX set to ``switch`` (None: unset): forked
    from the warm parent, or, where ``fresh`` says why, a fresh interpreter. ``ARGS`` that a warm parent
    cannot run (an option before the code, another executable, another PYTHONPATH) need ``fresh``."""
    env = env if env is not None else environment(switch)
    cwd = cwd or Path(os.environ.get("BNB_GC_FIX_TEST_AGAINST") or ROOT)  # `-c` puts the folder first
    if fresh is None:
        parent = warm_parent()
        unlike = parent.differs_at_start(env)
        runnable = args[:1] in (["-c"], ["-m"]) or (bool(args) and not args[0].startswith("-"))
        if executable != sys.executable or unlike or not runnable:
            raise ValueError(
                f"a warm parent cannot run {[executable, *args][:3]} (environment read at start: {unlike}): "
                "say why this scenario needs a fresh interpreter, run_python(..., fresh='why')"
            )
        warm = parent.run(args, env, cwd, timeout)
        if warm is not None:
            return warm
    completed = subprocess.run(
        [executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    return Run(completed.returncode, completed.stdout, completed.stderr)


# --- a run several tests read -------------------------------------------------------------------------
# A control that does not depend on a test's parameters runs once per test run, whichever worker asks
# first; the others wait for it and read its result, in the folder pytest made for the run (one
# pytest-N folder holds every xdist worker's own).

_shared_folder: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _shared_runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
    base = tmp_path_factory.getbasetemp()
    an_xdist_worker = hasattr(request.config, "workerinput")  # its folder is one of the run's folder's
    folder = (base.parent if an_xdist_worker else base) / "shared-runs"
    folder.mkdir(exist_ok=True)
    _shared_folder.append(folder)


def shared(name: str, make: Callable[[], Run]) -> Run:
    """``make()``'s Run, made once per test run under ``name`` and read by every test that asks."""
    folder = _shared_folder[0]
    result = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            made = make()
            result.write_text(json.dumps([made.returncode, made.stdout, made.stderr]))
    returncode, stdout, stderr = json.loads(result.read_text())
    return Run(returncode, stdout, stderr)


# Removes the start-up hook's watcher so a snippet exercises `import bnb_gc_fix` on its own.
WITHOUT_STARTUP_HOOK = """
import sys, _bnb_gc_fix
sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _bnb_gc_fix.Watcher)]
"""

# What tests/scenarios' helpers need: `sys` and `json` imported, and the folder importable (quantized, ...).
_SCENARIOS_ON_PATH = f"import sys, json\nsys.path.insert(0, {str(SCENARIOS)!r})\n"

# The preludes a snippet can start with, each defined once here: run_code(..., prelude=NAME).
Prelude = Literal["scenarios", "without-startup-hook", "scenarios-without-startup-hook"]
PRELUDES: dict[str, str] = {
    "scenarios": _SCENARIOS_ON_PATH,
    "without-startup-hook": WITHOUT_STARTUP_HOOK,
    "scenarios-without-startup-hook": WITHOUT_STARTUP_HOOK + _SCENARIOS_ON_PATH,
}


def run_code(
    code: str,
    *argv: str,
    prelude: Prelude | None = None,
    switch: str | None = None,
    check: bool = True,
    **kwargs: Any,
) -> Run:
    """Run a snippet in a process of its own (see run_python), with BNB_GC_FIX set to ``switch`` (None:
    unset).

    The snippet is dedented and starts with the named ``prelude`` (one of PRELUDES; None: none); ``argv``
    is its ``sys.argv[1:]``, the one way a test passes it values. With ``check`` (the default) a snippet
    that crashes fails the test with its output. Its result: ``.last_json``, ``.last_line``, ``.stdout``.
    """
    source = PRELUDES[prelude] if prelude is not None else ""
    source += textwrap.dedent(code)
    result = run_python(["-c", source, *argv], switch=switch, **kwargs)
    if check:
        assert result.returncode == 0, f"snippet failed:\n{result.stdout}\n{result.stderr}"
    return result


# `bnb-gc-fix` commands run one after another in one process of their own: each is the console
# script's main() with its stdout and stderr captured, and its exit code. A command leaves nothing
# behind that changes the next one's answer (each imports what it needs again, and a failed import
# is tried afresh), so one interpreter answers for several commands.
_CLI_CALLS = """
import contextlib, io, json, sys
from bnb_gc_fix.cli import main
CALLS = json.loads(sys.argv[1])
def call(args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return [code, out.getvalue(), err.getvalue()]
print("CLI_CALLS " + json.dumps([call(args) for args in CALLS]))
"""


def _parsed(result: Run) -> list[tuple[int, str, str]]:
    line = next(line for line in result.stdout.splitlines() if line.startswith("CLI_CALLS "))
    return [(code, out, err) for code, out, err in json.loads(line[len("CLI_CALLS ") :])]


def cli_calls(
    *calls: list[str], setup: str = "", switch: str | None = None, **kwargs: Any
) -> list[tuple[int, str, str]]:
    """``bnb-gc-fix ARGS`` for each of ``calls``, in one process of their own after the code ``setup``:
    ``(exit code, stdout, stderr)`` each."""
    return _parsed(run_code(setup + _CLI_CALLS, json.dumps(calls), switch=switch, **kwargs))


def command(*args: str, switch: str | None = None) -> tuple[int, str, str]:
    """``bnb-gc-fix ARGS`` with BNB_GC_FIX set to ``switch``, as the console script runs it: ``(exit code,
    stdout, stderr)``, made once per test run for each (ARGS, switch) and read by every test that asks
    (the check's runs: test_command_line's and the README's console block)."""
    name = "command " + " ".join([f"BNB_GC_FIX={switch}" if switch is not None else "", *args]).strip()
    name = re.sub(r"[^\w.=-]+", "_", name)
    [called] = _parsed(shared(name, lambda: run_code(_CLI_CALLS, json.dumps([list(args)]), switch=switch)))
    return called


def tiny_olmoe(*flags: str, switch: str | None = None, **kwargs: Any) -> Run:
    result = run_python([str(TINY_OLMOE), *flags], switch=switch, **kwargs)
    assert result.returncode == 0, f"tiny_olmoe failed:\n{result.stdout}\n{result.stderr}"
    return result


def tiny_olmoe_control() -> Run:
    """The tiny OLMoE, 5 steps, the package imported and switched off: the one control run of the bug
    report's reproduction, read by every test that compares with it."""
    return shared("tiny-olmoe-control", lambda: tiny_olmoe("--steps", "5", "--import-fix", switch="0"))


@dataclass(frozen=True)
class Venv:
    python: Path
    site_packages: Path


def bare_venv(path: Path, sees_this_environment: bool = False) -> Venv:
    """A venv of its own, without the package's start-up hook. ``sees_this_environment``: a plain path line
    in its site-packages puts this environment's on ``sys.path``, which processes none of the ``.pth``
    files there, so torch and bitsandbytes import while the start-up hook does not run."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    site_packages = Path(purelib)
    if sees_this_environment:
        (site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return Venv(python, site_packages)


def cache_root() -> Path:
    """Where test installs live, outside the work tree: $BNB_GC_FIX_TEST_CACHE, else
    ~/.cache/bnb-gc-fix-tests."""
    return Path(os.environ.get("BNB_GC_FIX_TEST_CACHE", Path.home() / ".cache" / "bnb-gc-fix-tests"))


def pip_target(spec: str) -> Path:
    """``pip install --no-deps --target`` one pinned requirement (``name==version``) into the test cache.

    Returns the folder, to put first on ``PYTHONPATH``. Installed once; a folder left half-made by an
    interrupted install is made again (its ``.complete`` marker is written last). Without
    BNB_GC_FIX_DOWNLOADS=1 nothing is downloaded: a folder not yet made skips the test.
    """
    target = cache_root() / spec
    marker = target / ".complete"
    if not DOWNLOADS and not marker.exists():  # never download in the README's command
        pytest.skip(downloads_reason(needs=spec))
    target.parent.mkdir(parents=True, exist_ok=True)
    # Parallel test workers ask for the same folder: one installs, the others wait for it.
    with open(target.parent / f".{spec}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            if target.exists():
                shutil.rmtree(target)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--target",
                    str(target),
                    spec,
                ],
                check=True,
            )
            marker.write_text(spec + "\n")
    return target


# --- tests that need another release downloaded ------------------------------------------------------
# The README's test command runs every test the `test` extra can run. Only a test that needs another
# release downloaded (other axolotl releases, bitsandbytes 0.50.2 via pip_target, bitsandbytes' own test
# files) is marked `downloads`; it runs where BNB_GC_FIX_DOWNLOADS=1: CI's downloads step (.ci/run) and
# every nox cell that selects it. Elsewhere it is skipped, saying so.
DOWNLOADS = os.environ.get("BNB_GC_FIX_DOWNLOADS") == "1"
DOWNLOADS_STEP = "CI's downloads step (.ci/run: BNB_GC_FIX_DOWNLOADS=1 python -m pytest -n auto -m downloads)"
# A test parametrized over a downloaded release (a notebook row or axolotl's run on bitsandbytes 0.50.2)
# needs the download for that case only: its id names the release.
DOWNLOADED_RELEASES = ("0.50.2",)


@functools.cache
def _cells() -> tuple[dict[str, Any], ...]:
    """The nox cells of cells.toml, read once per process."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11 (a bare cell): the reason names no cells
        return ()
    cells: list[dict[str, Any]] = tomllib.loads((ROOT / "cells.toml").read_text())["cells"]
    return tuple(cells)


def _cells_running(item: pytest.Item, cells: tuple[dict[str, Any], ...]) -> list[str]:
    """The nox cells whose selection holds ``item`` (its marker, or its file run whole)."""
    path = Path(str(item.path)).resolve()
    names = []
    for cell in cells:
        files = {(ROOT / f).resolve() for f in cell["files"]}
        if cell["marker"] in item.keywords or path in files:
            names.append(cell["name"])
    return names


def downloads_reason(item: pytest.Item | None = None, needs: str = "another release") -> str:
    """Why a `downloads` test is skipped here, and where it runs."""
    cells = _cells_running(item, _cells()) if item is not None else []
    where = f"in the nox cell(s) {', '.join(cells)}" if cells else "in no nox cell"
    return f"needs {needs} downloaded; runs with BNB_GC_FIX_DOWNLOADS=1: in {DOWNLOADS_STEP} and {where}"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which makes -n's workers distribute by "load"
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``-n`` distributes with ``worksteal``: a worker that runs out of tests takes the other's, so a long
    scenario never ends the run alone. Without pytest-xdist (or with ``-p no:xdist``) nothing changes."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the cases of a parametrized test that run on a downloaded release `downloads`; skips every
    `downloads` test unless BNB_GC_FIX_DOWNLOADS=1."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(release in callspec.id for release in DOWNLOADED_RELEASES):
            item.add_marker(pytest.mark.downloads)
    if DOWNLOADS:
        return
    for item in items:
        if "downloads" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=downloads_reason(item)))


@pytest.fixture(scope="session")
def startup_hook_installed() -> None:
    """The suite tests the real start-up hook: the package must be installed (pip install -e .)."""
    result = run_code("import sys; print('_bnb_gc_fix' in sys.modules)", fresh="what interpreter start ran")
    if result.stdout.strip() != "True":
        pytest.fail("zz_bnb_gc_fix.pth was not processed at start-up: install the package (pip install -e .)")
