"""In company the fix is no worse than the pair it replaces: forks, other hooks, copies, other threads.

Pickles: ``test_picklers.py``.

Each scenario runs in fresh interpreters beside its control (``BNB_GC_FIX=0``: bitsandbytes' own plain
pair). The rule: where the control runs, the fixed run runs too, and ends no worse.
"""

from __future__ import annotations

import pytest
from conftest import AFFECTED, FIX, SCENARIOS, run_code, run_python

# --- fork -----------------------------------------------------------------------------------------


def _forks(switch: str | None) -> dict[str, object]:
    result = run_python([str(SCENARIOS / "forking.py")], switch=switch, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(result.records[-1])


@pytest.mark.stack
def test_a_forked_child_never_blocks_and_keeps_only_its_own_threads_switch_ons() -> None:
    fixed, control = _forks(FIX), _forks("0")
    children = fixed["children"]
    assert isinstance(children, list)
    # The serving thread stopped inside every function of the package its inner call ran, and once
    # inside the inner forward: a child forked at each stop.
    assert len(children) > 2 and {"stop": "inside the inner forward", "at_fork": 0, "after": 0} in children
    # ...the functions that nest the inner call in the outer one and give its entry back among them.
    assert {"outer_call_running", "nest", "unnest"} <= {child["stop"] for child in children}
    for child in children:
        assert child == {"stop": child["stop"], "at_fork": 0, "after": 0}  # never hung, never inherited
    # The control's child inherits the serving thread's two switch-ons (outer and inner call) for good.
    assert control["children"] == [{"stop": "inside the inner forward", "at_fork": 2, "after": 2}]
    assert fixed["end"] == control["end"] == 0


# --- hook order -----------------------------------------------------------------------------------

ORDER = """
import torch
import torch.nn.utils.parametrize as P
from bitsandbytes.nn import parametrize
import quantized
seen = []
def pre(name):
    return lambda module, args: seen.append((name, P._cache_enabled > 0))
def post(name):
    return lambda module, args, output: seen.append((name, P._cache_enabled > 0))
torch.manual_seed(0)
module = quantized.Quantized(params=2)
for when in ("before", "between", "after"):
    module.register_forward_pre_hook(pre("pre-hook " + when))
    module.register_forward_hook(post("forward hook " + when))
    if when == "before":
        parametrize.replace_parameter_4bit(module, "w0", quant_type="nf4")
    elif when == "between":
        parametrize.replace_parameter_4bit(module, "w1", quant_type="nf4")
module(torch.randn(2, 64))
print(json.dumps(seen))
"""


def test_other_hooks_run_where_they_ran_relative_to_the_cache_switching() -> None:
    fixed = run_code(ORDER, prelude="scenarios", switch=FIX).last_json
    control = run_code(ORDER, prelude="scenarios", switch="0").last_json
    assert fixed == control
    assert control == [
        ["pre-hook before", False],
        ["pre-hook between", True],
        ["pre-hook after", True],
        ["forward hook before", True],
        ["forward hook between", True],
        ["forward hook after", False],
    ]


MONITOR = """
import torch
from torch.nn.utils.parametrizations import weight_norm
import quantized

class Block(quantized.Quantized):
    def __init__(self):
        super().__init__(params=1)
        self.out = weight_norm(torch.nn.Linear(64, 64))

    def forward(self, x):
        return self.out(super().forward(x))

torch.manual_seed(0)
block = Block()
norms = []
# A monitoring pre-hook registered before quantizing: reads the weight_norm weight under no_grad.
def monitor(module, args):
    with torch.no_grad():
        norms.append(float(module.out.weight.norm()))
block.register_forward_pre_hook(monitor)
quantized.quantize(block)
original = block.out.parametrizations.weight.original1
before = original.detach().clone()
optimizer = torch.optim.SGD(block.out.parameters(), lr=0.1)
for step in range(2):
    block(torch.randn(4, 64)).pow(2).mean().backward()
    optimizer.step(); optimizer.zero_grad()
print(json.dumps({"trained": not torch.equal(before, original.detach()), "monitored": len(norms)}))
"""


def test_a_monitoring_pre_hook_registered_before_quantizing_leaves_weight_norm_training() -> None:
    fixed = run_code(MONITOR, prelude="scenarios", switch=FIX).last_json
    control = run_code(MONITOR, prelude="scenarios", switch="0").last_json
    assert control == fixed == {"trained": True, "monitored": 2}


# --- torch's hook dictionaries ---------------------------------------------------------------------

# A forward hook registered with always_call=True removes its own entry of torch's always-called
# dictionary, whether it was registered before the module was quantized or after.
HANDLES = """
import torch
import quantized
torch.manual_seed(0)
module = quantized.Quantized(params=2)
before = module.register_forward_hook(lambda m, a, o: None, always_call=True)
torchs_own = module._forward_hooks_always_called
quantized.quantize(module)
after = module.register_forward_hook(lambda m, a, o: None, always_call=True)
plain = quantized.make(params=1)  # nothing always-called of its own before it was quantized
late = plain.register_forward_hook(lambda m, a, o: None, always_call=True)
for handle in (before, after, late):
    handle.remove()
always = {module: module._forward_hooks_always_called, plain: plain._forward_hooks_always_called}
owners = {before: module, after: module, late: plain}
print(json.dumps({
    "left": [handle.id for handle, owner in owners.items() if handle.id in always[owner]],
    "entries": [len(entries) for entries in always.values()],
    "torchs_own": module._forward_hooks_always_called is torchs_own,
    "counters": quantized.checkpointed_counters(module) + quantized.checkpointed_counters(plain),
}))
"""


def test_a_handle_removes_its_always_called_entry_before_and_after_quantization() -> None:
    fixed = run_code(HANDLES, prelude="scenarios", switch=FIX).last_json
    control = run_code(HANDLES, prelude="scenarios", switch="0").last_json
    assert fixed["left"] == control["left"] == []
    assert control["entries"] == ([2, 1] if not AFFECTED else [0, 0])  # bitsandbytes' own, if any
    assert fixed["entries"] == [1, 1]  # the fix's forward hook, one a module
    assert fixed["torchs_own"] is control["torchs_own"] is True  # the dictionary is torch's object still
    assert fixed["counters"] == [0] * 6


# Module objects that share their hook dictionaries (DataParallel's replicas): one of them covered, the
# others hold one always-called pair too, since the dictionaries themselves were edited.
SHARED = """
import torch
import quantized
module = quantized.make(params=2)  # before the fix is on: bitsandbytes' own plain pairs
replica = object.__new__(type(module))  # shares the hook dictionaries, as DataParallel's replicas do
replica.__dict__ = module.__dict__.copy()
import bnb_gc_fix
replica(torch.randn(2, 64))  # its next forward covers it (the control: bitsandbytes' own pairs ran)
pairs = [len(module._forward_pre_hooks), len(module._forward_hooks_always_called)]
print(json.dumps({"pairs": pairs, "counters": quantized.checkpointed_counters(module)}))
"""


def test_covering_one_of_modules_sharing_their_hook_dictionaries_covers_them_all() -> None:
    fixed = run_code(SHARED, prelude="scenarios-without-startup-hook").last_json
    control = run_code(SHARED, prelude="scenarios-without-startup-hook", switch="0").last_json
    assert fixed == {"pairs": [1, 1], "counters": [0, 0, 0]}
    assert control["pairs"] == [2, 0]
    if AFFECTED:
        assert control["counters"][-1] > control["counters"][0] > 0


COPY = """
import copy, torch
import quantized, bnb_gc_fix
module = quantized.make(params=2)
clone = copy.deepcopy(module)
x = torch.randn(2, 64)
seen = [quantized.interrupted_forward(module, x)]  # the original's, left on
clone(x)
seen.append(quantized.counter())  # the clone's are its own: it leaves the original's alone
quantized.interrupted_forward(clone, x)
clone(x)
seen.append(quantized.counter())  # ...and heals its own
module(x)
seen.append(quantized.counter())
print(json.dumps(seen))
"""


def test_a_deep_copy_has_switch_ons_of_its_own() -> None:
    assert run_code(COPY, prelude="scenarios", switch=FIX).last_json == [1, 1, 1, 0]


# Another tool wraps a covered module's pre-hook (a functools.partial of it), and the module is deep-copied
# (an EMA or a teacher copy): the module stays covered, and the copy cannot be covered (its pre-hook is not
# the fixed function), so it runs the library's own arithmetic, its off hook no longer marked always called
# (a second reviewer's finding on an earlier version: 3 after three forwards, 0 without the fix). The
# counter after three forwards of each, then after one that raises.
WRAPPED_THEN_COPIED = """
import copy, functools, torch
import bnb_gc_fix, quantized
module = quantized.make(params=1)
x = torch.randn(2, 64)
module(x)
key = next(iter(module._forward_pre_hooks))
module._forward_pre_hooks[key] = functools.partial(module._forward_pre_hooks[key])
clone = copy.deepcopy(module)
seen = {}
for name, each in (("module", module), ("copy", clone)):
    for _ in range(3):
        each(x)
    seen[name] = [quantized.counter()]
    try:
        each(x, fail=True)
    except RuntimeError:
        pass
    seen[name].append(quantized.counter())
    quantized.reset()
status = bnb_gc_fix.status()
print(json.dumps({"seen": seen, "state": status.state if status.fixed else None}))
"""


def test_a_wrapped_pre_hook_and_a_copy_of_its_module_leave_no_more_than_the_control() -> None:
    fixed = run_code(WRAPPED_THEN_COPIED, prelude="scenarios", switch=FIX).last_json
    control = run_code(WRAPPED_THEN_COPIED, prelude="scenarios", switch="0").last_json
    if AFFECTED:  # bitsandbytes 0.48-0.49's plain pair: a forward that raises leaves its +1
        assert control["seen"] == {"module": [0, 1], "copy": [0, 1]}
    assert fixed["seen"] == {"module": [0, 0], "copy": [0, 1]}, fixed  # the copy: as the control
    for name in ("module", "copy"):
        assert fixed["seen"][name][1] <= control["seen"][name][1]
    assert fixed["state"] == "unprotected"  # the copy cannot be covered, and status says so


# Issue 54: a module of two quantized weights whose pre-hooks stand behind another tool's function runs as
# without the fix: the library's own arithmetic, unclamped (+1 for each pre-hook call, -1 for each off hook
# call, the cache emptied at 0), its off hooks plain. The counter and the cache's entries after each way
# a forward ends, beside the control:
# - "lambda": the tool replaces bitsandbytes' _enable_parametrization_cache with a lambda that calls it,
#   before anything is quantized, the fix on from the start (the start-up hook);
# - "wrapped": the tool wraps each pre-hook in the module's hook dictionary, in a process started with
#   BNB_GC_FIX=0, then activate() (the control: no activate());
# - "copied": the tool wraps a covered module's pre-hooks so, and the module is deep-copied (an EMA or a
#   teacher copy): the copy, whose off hook the covered module's mark came with, is the module here (of
#   one quantized weight: the fix folded the covered module's pairs into one).
BEHIND_ANOTHER_TOOL = """
import copy, functools, os, torch
import torch.nn.utils.parametrize as P
from bitsandbytes.nn import parametrize
import quantized
tool, activate = sys.argv[1], sys.argv[2] == "activate"
if tool == "lambda":
    enable = parametrize._enable_parametrization_cache
    parametrize._enable_parametrization_cache = lambda module, inputs: enable(module, inputs)

class Block(quantized.Quantized):
    def forward(self, x, fail=False, cached=False):
        if cached:  # a P.cached() block inside the forward
            with P.cached():
                return super().forward(x, fail)
        return super().forward(x, fail)

torch.manual_seed(0)
module = quantized.quantize(Block(params=1 if tool == "copied" else 2))
if tool in ("wrapped", "copied"):
    hooks = module._forward_pre_hooks
    for key in list(hooks):
        hooks[key] = functools.partial(hooks[key])
if tool == "copied":
    module = copy.deepcopy(module)
if activate:
    os.environ["BNB_GC_FIX"] = "auto"
    import bnb_gc_fix
    bnb_gc_fix.activate()
x = torch.randn(2, 64)

def refuse(module, args):
    raise ValueError("another tool's pre-hook refuses")

def refused(prepend):
    handle = module.register_forward_pre_hook(refuse, prepend=prepend)
    try:
        module(x)
    finally:
        handle.remove()

def interrupted():
    quantized.interrupted_forward(module, x)
    seen["a Ctrl-C, before the next forward"] = [quantized.counter(), len(P._cache)]
    module(x)

def in_a_block():
    with P.cached():
        module(x)
        seen["a forward inside a P.cached() block, in the block"] = [quantized.counter(), len(P._cache)]

def failing_in_a_block():
    with P.cached():
        try:
            module(x, fail=True)
        except RuntimeError:
            pass
        seen["a forward that raises inside a P.cached() block, in the block"] = [quantized.counter()]

seen = {}
for name, forward in {
    "a forward": lambda: module(x),
    "a forward that raises": lambda: module(x, fail=True),
    "a tool's pre-hook ahead of the library's that raises": lambda: refused(prepend=True),
    "a tool's pre-hook after the library's that raises": lambda: refused(prepend=False),
    "a forward inside a P.cached() block": in_a_block,
    "a forward that raises inside a P.cached() block": failing_in_a_block,
    "a P.cached() block inside the forward": lambda: module(x, cached=True),
    "a P.cached() block inside a forward that raises": lambda: module(x, fail=True, cached=True),
    "a Ctrl-C, then the next forward": interrupted,
}.items():
    try:
        forward()
    except (RuntimeError, ValueError):
        pass
    seen[name] = [quantized.counter(), len(P._cache)]
    quantized.reset()
fix = sys.modules.get("bnb_gc_fix")
status = fix.status() if fix and fix.status().fixed else None
print(json.dumps({"seen": seen, "state": status and status.state, "reason": status and status.reason}))
"""

BEHIND = {  # the tool, and how the fix is on: the fixed run's switch and activate(), the control's
    "lambda": ((FIX, "start-up"), ("0", "start-up")),
    "wrapped": (("0", "activate"), ("0", "no-activate")),
    "copied": ((FIX, "start-up"), ("0", "start-up")),
}


@pytest.mark.parametrize("tool", list(BEHIND))
def test_a_module_behind_another_tools_pre_hooks_leaves_the_counter_where_the_control_does(tool: str) -> None:
    (switch, how), (control_switch, control_how) = BEHIND[tool]
    fixed = run_code(BEHIND_ANOTHER_TOOL, tool, how, prelude="scenarios", switch=switch).last_json
    control = run_code(BEHIND_ANOTHER_TOOL, tool, control_how, prelude="scenarios", switch=control_switch)
    seen = control.last_json["seen"]
    assert seen["a forward"] == [0, 0]
    assert seen["a forward inside a P.cached() block, in the block"][0] == 1  # the block's own count
    if AFFECTED:  # bitsandbytes 0.48-0.49's plain pairs: what an exception leaves stays on
        pairs = 1 if tool == "copied" else 2
        assert seen["a forward that raises"][0] == seen["a Ctrl-C, then the next forward"][0] == pairs
    assert fixed["seen"] == seen, fixed  # each way a forward ends: where the control leaves it
    assert fixed["state"] == "unprotected"  # an exception leaving its forward leaves the cache on: said
    why = (
        "leaks this way: the fix is in bitsandbytes' hooks, but another function stands in the place of "
        "their pre-hook (another tool's), so the fix cannot cover them"
    )
    assert why in fixed["reason"], fixed["reason"]  # was: "the fix could not be put in: None"


# The known limit (docs/how-it-works.md): a module the fix cannot cover whose hook dictionaries a covered
# module shares, as DataParallel's replicas share their original's (a shallow copy of its __dict__), after
# another tool wrapped the pre-hook in that dictionary. The fix cannot drop the mark from the off hook
# without unmarking the covered module's too, so torch calls it when a forward raises: where the
# replica's forward raises, the counter ends at 0 (the control: 1), and where a pre-hook ahead of the
# library's raises, at -1 (the control: 0). The covered module itself stays covered.
SHARED_AND_UNCOVERABLE = """
import functools, torch
import quantized
module = quantized.make(params=1)
x = torch.randn(2, 64)
module(x)
replica = object.__new__(type(module))
replica.__dict__ = module.__dict__.copy()  # shares the hook dictionaries, as DataParallel's replicas do
hooks = replica._forward_pre_hooks
for key in list(hooks):
    hooks[key] = functools.partial(hooks[key])

def refuse(module, args):
    raise ValueError("a pre-hook ahead of bitsandbytes' refuses")

def refused():
    handle = replica.register_forward_pre_hook(refuse, prepend=True)
    try:
        replica(x)
    finally:
        handle.remove()

seen = {}
for name, forward in {
    "a forward": lambda: replica(x),
    "a forward that raises": lambda: replica(x, fail=True),
    "a pre-hook ahead that raises": refused,
    "a Ctrl-C": lambda: quantized.interrupted_forward(replica, x),
    "the covered module's forward that raises": lambda: module(x, fail=True),
}.items():
    try:
        forward()
    except (RuntimeError, ValueError):
        pass
    seen[name] = quantized.counter()
    quantized.reset()
fix = sys.modules.get("bnb_gc_fix")
state = fix.status().state if fix and fix.status().fixed else None
marked = len(module._forward_hooks_always_called)
print(json.dumps({"seen": seen, "state": state, "marked": marked}))
"""


@pytest.mark.skipif(not AFFECTED, reason="needs an affected bitsandbytes (0.50's own off hook is marked)")
def test_known_limit_a_module_sharing_a_covered_modules_hook_dictionaries_keeps_the_mark() -> None:
    fixed = run_code(SHARED_AND_UNCOVERABLE, prelude="scenarios", switch=FIX).last_json
    control = run_code(SHARED_AND_UNCOVERABLE, prelude="scenarios", switch="0").last_json
    assert control == {
        "seen": {
            "a forward": 0,
            "a forward that raises": 1,
            "a pre-hook ahead that raises": 0,
            "a Ctrl-C": 1,
            "the covered module's forward that raises": 1,
        },
        "state": None,
        "marked": 0,
    }
    assert fixed == {
        "seen": {
            "a forward": 0,
            "a forward that raises": 0,  # its off hook, marked, ran: better than the control
            "a pre-hook ahead that raises": -1,  # ...and ran without its pre-hook: worse than the control
            "a Ctrl-C": 1,  # as the control
            "the covered module's forward that raises": 0,
        },
        "state": "unprotected",  # the replica cannot be covered
        "marked": 1,  # the covered module's off hook, which the replica's is
    }


# Issue 50's finding 4: bitsandbytes' hook functions under the fix take the names they bind keyword-only,
# so an argument too many fails as the library's own functions fail (8dd19c6: AttributeError, the extra
# argument taken for torch's parametrize module).
EXTRA_ARGUMENT = """
import torch
from bitsandbytes.nn import parametrize
module = torch.nn.Module()
calls = {
    "pre-hook": (parametrize._enable_parametrization_cache, (module, (), "one too many")),
    "off hook": (parametrize._disable_parametrization_cache, (module, (), None, "one too many")),
}
raised = {}
for name, (function, arguments) in calls.items():
    try:
        function(*arguments)
        raised[name] = None
    except Exception as error:
        raised[name] = type(error).__name__
print(json.dumps({"raised": raised, "counter": int(torch.nn.utils.parametrize._cache_enabled)}))
"""


def test_an_argument_too_many_fails_as_the_librarys_own_hook_functions_fail() -> None:
    fixed = run_code(EXTRA_ARGUMENT, prelude="scenarios", switch=FIX).last_json
    control = run_code(EXTRA_ARGUMENT, prelude="scenarios", switch="0").last_json
    assert control == {"raised": {"pre-hook": "TypeError", "off hook": "TypeError"}, "counter": 0}
    assert fixed == control


# Issue 46's finding 1: a server that quantizes a module per request and drops it ends with what it
# started with: no record of the fix grows with the modules it has seen. Measured with tracemalloc after a
# warm-up, beside the control (the fix off). What may differ is bounded by the modules alive at once, not
# by those ever seen: the tables of weakref.finalize's registry and of the covered modules' record, which
# Python's dictionaries keep at their largest size (about 30 KB here; 777 KB on 616ce13, whose record of
# marked keys grew by one key a module).
SERVER = """
import gc, tracemalloc, torch
import bnb_gc_fix, quantized
x = torch.randn(2, 64)

def serve(requests):
    for _ in range(requests):
        module = quantized.make(params=1)
        module(x)
        del module

serve(300)
gc.collect()
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
serve(int(sys.argv[1]))
gc.collect()
grown = tracemalloc.get_traced_memory()[0] - before
print(json.dumps({"grown": grown, "counter": quantized.counter()}))
"""


def test_a_server_quantizing_a_module_per_request_grows_no_more_than_the_control() -> None:
    fixed = run_code(SERVER, "3000", prelude="scenarios", switch=FIX).last_json
    control = run_code(SERVER, "3000", prelude="scenarios", switch="0").last_json
    assert fixed["counter"] == control["counter"] == 0
    assert fixed["grown"] <= control["grown"] + 64 * 1024, (fixed, control)


# Issue 41's finding 3: a thread whose record is empty when it ends leaves torch's counter untouched:
# neither read nor written (on Python 3.9 another thread's `+= 1` in between would be lost); a thread that
# still has a switch-on (a Ctrl-C inside its forward) switches it off. torch's parametrize module is watched.
THREAD_ENDS = """
import gc, threading, types, torch
import torch.nn.utils.parametrize as P
import bnb_gc_fix, quantized
touched = []

class Watched(types.ModuleType):
    @property
    def _cache_enabled(self):
        touched.append("read")
        return self.__dict__["_cache_enabled"]

    @_cache_enabled.setter
    def _cache_enabled(self, value):
        touched.append("write")
        self.__dict__["_cache_enabled"] = value

module = quantized.make(params=1)
x = torch.randn(2, 64)
P.__class__ = Watched
seen = {}
for left_on in (False, True):
    def work():
        module(x)  # switches the cache on and off
        if left_on:
            quantized.interrupted_forward(module, x)  # and on again, left by a KeyboardInterrupt
        touched.clear()
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    del thread, work
    gc.collect()
    after = {"at its end": list(touched), "after": P._cache_enabled}
    seen["left on" if left_on else "nothing on"] = after
print(json.dumps(seen))
"""


def test_a_thread_with_nothing_on_touches_nothing_when_it_ends() -> None:
    fixed = run_code(THREAD_ENDS, prelude="scenarios", switch=FIX).last_json
    assert fixed["nothing on"] == {"at its end": [], "after": 0}  # was a read and a write
    assert fixed["left on"]["at its end"] == ["read", "write"] and fixed["left on"]["after"] == 0
    # The control: bitsandbytes' own pair does nothing when a thread ends; what a Ctrl-C left stays.
    control = run_code(THREAD_ENDS, prelude="scenarios", switch="0").last_json
    assert control["nothing on"] == {"at its end": [], "after": 0}
    assert control["left on"] == {"at its end": [], "after": 1}


# --- other threads ----------------------------------------------------------------------------------

THREADS = """
import threading, torch
import bnb_gc_fix, quantized

looked = []
original = sys._current_frames
sys._current_frames = lambda: looked.append(1) or original()  # reading every thread's stack

class Chunked(quantized.Quantized):
    def forward(self, x, whole=True, pause=None):
        if pause is not None:
            pause()
        if whole:
            return torch.cat([self(chunk, whole=False) for chunk in x.chunk(4)])
        return super().forward(x)

torch.manual_seed(0)
module = quantized.quantize(Chunked(params=1))
x = torch.randn(8, 64)
inside, leave = threading.Event(), threading.Event()
def held_open():
    module(x, pause=lambda: (inside.set(), leave.wait()))
holder = threading.Thread(target=held_open)
holder.start()
inside.wait()
seen = [quantized.counter()]  # the holder's live call
quantized.interrupted_forward(module, x[:2])  # this thread's call, left by Ctrl-C
module(x)  # switches off what this thread's Ctrl-C left, keeps the other thread's
seen.append(quantized.counter())
def serve():
    for _ in range(20):
        module(x)
pool = [threading.Thread(target=serve) for _ in range(4)]
for thread in pool: thread.start()
for thread in pool: thread.join()
seen.append(quantized.counter())
leave.set()
holder.join()
seen.append(quantized.counter())
print(json.dumps({"counters": seen, "looked": len(looked)}))
"""


@pytest.mark.stack
def test_threads_never_look_at_each_others_stacks_and_heal_only_their_own() -> None:
    fixed = run_code(THREADS, prelude="scenarios", switch=FIX).last_json
    control = run_code(THREADS, prelude="scenarios", switch="0").last_json
    assert fixed == {"counters": [1, 1, 1, 0], "looked": 0}
    # The control's pair keeps the interrupted calls' switch-ons (outer and inner chunk) for good.
    assert control["counters"][0] == 1 and control["counters"][-1] == 2
