"""A warm parent: imports torch, bitsandbytes and transformers (PRELOADED) once, then forks a child per
scenario.

    python tests/warm_parent.py REQUESTS_FD REPLIES_FD

Started by ``conftest.py`` once per test worker, with ``BNB_GC_FIX=0`` so that its start-up hook did
nothing, it reads one JSON request a line (``argv``, ``env``, ``cwd``, ``stdout``, ``stderr``: the
scenario's ``python`` arguments, environment, folder, and the files its output goes to) and forks a child
for each. It answers the child's pid, then its exit status once it has ended.

The child starts from the state a fresh interpreter of that environment reaches after its first
``import torch, bitsandbytes, transformers`` (and the modules of PRELOADED), where the package is not
imported yet: torch's counter at 0, ``bitsandbytes.nn.parametrize`` not imported (bitsandbytes 0.48-0.49
import it only when asked), no hook of anyone's on any module. It takes the scenario's environment,
folder, ``sys.argv``, ``sys.path[0]`` and standard streams, runs the start-up hook as
``zz_bnb_gc_fix.pth`` does, runs the code as ``python -c CODE``, ``python -m MODULE`` or ``python
SCRIPT`` would, and ends as an interpreter begins its end (its threads joined, ``atexit`` run, its
streams flushed), without tearing its modules down (:func:`_end`).

What it cannot be is a process in which the start-up hook ran before anything was imported: the tests
that look at interpreter start, import order, or Python's options run in fresh interpreters
(``run_python(..., fresh="why")``).
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import importlib.machinery
import json
import os
import runpy
import sys
import threading
import types
from typing import TextIO

#: What the scenarios import first, paid once here, never again in a child: what of it is installed. The
#: package watches none of transformers' modules, so importing them before it changes nothing it does.
PRELOADED = (
    "torch",
    "torch.utils.checkpoint",
    "bitsandbytes",
    "transformers",
    "transformers.models.olmoe.modeling_olmoe",
    "transformers.models.llama.modeling_llama",
    "transformers.trainer",
)

#: Modules a fresh interpreter of the scenario imports only itself, where it runs the fix's code.
NOT_HERE = ("bnb_gc_fix", "bitsandbytes.nn.parametrize", "axolotl")
SERVER_FILE = os.path.abspath(__file__)


def _preload() -> None:
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:  # not installed in this environment (a nox cell without it)
            pass


def _threads() -> int:
    """The threads of this process, the native ones included where the system lists them."""
    tasks = "/proc/self/task"
    return len(os.listdir(tasks)) if os.path.isdir(tasks) else threading.active_count()


def _pristine() -> str | None:
    """What makes this process unlike a fresh interpreter's start, if anything."""
    imported = [name for name in NOT_HERE if name in sys.modules]
    if imported:
        return f"imported already: {imported}"
    if threading.active_count() != 1 or _threads() != 1:
        return "a thread besides the main one is running: forking would strand it"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized: a forked child could not use it"
    return None


def _exit_code(error: SystemExit) -> int:
    """What Python's own exit makes of a SystemExit's code."""
    code = error.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _report(error: BaseException) -> int:
    """An uncaught exception as Python reports it, without this file's frames."""
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == SERVER_FILE:
        tb = tb.tb_next
    sys.excepthook(type(error), error.with_traceback(tb), tb)
    return 1


def _become(request: dict[str, object], requests: TextIO, replies: int) -> None:
    """In the child: a process group of its own (a timeout ends its children too), and the scenario's
    streams, environment and folder."""
    os.setpgid(0, 0)
    requests.close()
    os.close(replies)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in dict(request["env"]).items()})  # type: ignore[call-overload]
    os.chdir(str(request["cwd"]))
    importlib.invalidate_caches()  # files the test wrote after this process started


def _run(argv: list[str]) -> int:
    """``python -c CODE ARGS``, ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``, after the start-up hook
    as the .pth runs it."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    startup = sys.modules.get("_bnb_gc_fix")
    if startup is not None and startup.started:  # this environment runs the .pth file: so would the child
        startup.install()  # as zz_bnb_gc_fix.pth does (it raises nothing)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main.__dict__.update(__spec__=None, __loader__=importlib.machinery.BuiltinImporter)
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        elif argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]  # runpy puts the module's file first, as python -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as error:
        return _exit_code(error)
    except BaseException as error:
        return _report(error)
    return 0


def serve(requests: int, replies: int) -> int | None:
    """Fork a child for each request; the child returns its exit code from here, the parent None at the
    end of its requests."""
    _preload()
    problem = _pristine()
    if problem is not None:
        os.write(replies, (json.dumps({"error": problem}) + "\n").encode())
        return None
    lines = os.fdopen(requests, "r", buffering=1)
    for line in lines:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become(request, lines, replies)
            return _run(request["argv"])
        os.write(replies, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os.write(replies, (json.dumps({"returncode": code}) + "\n").encode())
    return None


def _end(code: int) -> None:
    """The child's end, as an interpreter's begins: its threads joined, ``atexit`` run (weakref
    finalizers and logging's flush included), its streams flushed; then ``os._exit``, as a child of
    ``multiprocessing``'s fork does. What it skips is tearing the modules down (about 1.5 s of CPU with
    torch and transformers imported): a test that looks at that teardown runs in a fresh interpreter."""
    # What the interpreter's own end calls first: threading's exit callbacks (a ThreadPoolExecutor's,
    # which tell its idle workers to stop), then a join of every thread that is not a daemon.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a stream closed or gone: Python's own exit gives up on it too
            code = code or 120
    os._exit(code)


if __name__ == "__main__":
    code = serve(int(sys.argv[1]), int(sys.argv[2]))
    if code is not None:  # a child
        _end(code)
