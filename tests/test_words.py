"""What the package prints, in the situations a user meets: every line at most 100 characters, in the
README's words (the cache, the counter, the forwards that switched it on, the fix, on and off), none of
the package's own vocabulary, and every state word it prints explained in the README (issue 42).

Each situation is a process of its own that prints what ``print(status())``, ``bnb-gc-fix status``,
``bnb-gc-fix check`` and a notebook cell's report say there, and the package's warnings.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import ROOT, environment, pip_target, run_code

# What torch and bitsandbytes print on their own (FutureWarnings), and Dynamo's log: never the package's.
FOREIGN = ("FutureWarning", "_check_is_size", "torch._check", "kernels", "torch._dynamo")

WIDTH = 100
OWN_WORDS = re.compile(r"\b(hold|holds|held|taken over|take over|let go|armed)\b", re.I)

WORDS = """
import contextlib, io, os, warnings
import torch
situation = sys.argv[1]
import quantized
if situation == "a late import":  # quantized before the package is imported (no start-up hook)
    model = quantized.make(params=2)
if situation == "hooks it cannot read":  # the pre-hook in a partial (no start-up hook): the fix stays out
    from functools import partial
    from bitsandbytes.nn import parametrize
    parametrize._enable_parametrization_cache = partial(parametrize._enable_parametrization_cache)
import bnb_gc_fix
from bnb_gc_fix.cli import main
from bnb_gc_fix.notebook import Span  # what a notebook cell's end runs
printed = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if situation in ("protected", "switched off", "switched off at run time", "bitsandbytes 0.50",
                     "hooks it cannot read"):
        model = quantized.make(params=2)
    if situation == "switched off at run time":
        os.environ["BNB_GC_FIX"] = "0"
        bnb_gc_fix.activate()  # too late: it says so
    if situation != "nothing quantized":
        quantized.checkpointed_counters(model, steps=1)  # a step that leaks where the fix is off
        cell = Span.begin()
        quantized.interrupted_forward(model, torch.randn(2, 64))  # a cell a Ctrl-C left: reported
        printed.append(cell.end().report("bnb_gc_fix", "this cell"))
ours = [w for w in caught if issubclass(w.category, bnb_gc_fix.BnbGcFixWarning)]
printed += [warnings.formatwarning(w.message, w.category, "train.py", 12) for w in ours]
printed.append(str(bnb_gc_fix.status()))
for args in (["status"], ["check", "--device", "cpu", "--steps", "1"], ["check", "--device", "cuda"]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(args)
    printed += [out.getvalue(), err.getvalue()]
print(json.dumps(printed))
"""

SITUATIONS: dict[str, dict[str, Any]] = {
    # An unknown switch value too: its warning is printed as the start-up hook asks for the fix.
    "nothing quantized": {"switch": "sometimes"},
    "protected": {},
    "switched off": {"switch": "0"},
    "switched off at run time": {},
    "a late import": {"prelude": "scenarios-without-startup-hook"},
    "hooks it cannot read": {"prelude": "scenarios-without-startup-hook"},
    "bitsandbytes 0.50": {"release": "0.50.2"},
}


def _explained_in_the_readme() -> set[str]:
    """The words the README's table of states and its line on check's verdicts explain."""
    readme = (ROOT / "README.md").read_text()
    states = {row.split("|")[1].strip().strip("`") for row in readme.splitlines() if row.startswith("| `")}
    verdicts = set(re.findall(r"`([a-zA-Z ]+)`", readme[readme.index("its last line says") :][:200]))
    return states | verdicts


@pytest.mark.parametrize(
    "situation",
    [
        pytest.param(name, id=f"{name} {facts.get('release', '')}".strip())
        for name, facts in SITUATIONS.items()
    ],
)
def test_every_printed_line_is_short_and_in_the_readmes_words(situation: str) -> None:
    facts = SITUATIONS[situation]
    prelude = facts.get("prelude", "scenarios")
    if "release" in facts:
        env = environment(PYTHONPATH=str(pip_target(f"bitsandbytes=={facts['release']}")))
        result = run_code(WORDS, situation, prelude=prelude, env=env, fresh="bitsandbytes 0.50 on PYTHONPATH")
    else:
        result = run_code(WORDS, situation, prelude=prelude, switch=facts.get("switch"))
    everything = "\n".join([*result.last_json, result.stderr]).splitlines()
    # A warning's first line starts with Python's own `FILE:LINE: Category: `: measured as for a script
    # called train.py, wherever the scenario's files lie.
    located = [re.sub(r"^\S+:\d+: (\w+Warning): ", r"train.py:12: \1: ", line) for line in everything]
    lines = [line for line in located if not any(noise in line for noise in FOREIGN)]
    printed = "\n".join(lines)
    assert [line for line in lines if len(line) > WIDTH] == []
    assert OWN_WORDS.findall(printed) == [], printed
    said = {
        match.group(1)
        for match in re.finditer(r"^state: (not affected|protected|unprotected):", printed, re.M)
    }
    verdicts = {line.split(":")[0] for line in lines if re.match(r"^(protected|not affected|LEAK): ", line)}
    assert said and verdicts and (said | verdicts) <= _explained_in_the_readme(), (said, verdicts)
    if situation == "nothing quantized":
        assert "SwitchValueWarning: BNB_GC_FIX='sometimes' is not a known value" in printed
    if situation == "switched off at run time":
        assert (
            "SwitchValueWarning: BNB_GC_FIX='0' came too late: the fix stays on in this process." in printed
        )
    if situation != "nothing quantized":
        assert "bnb_gc_fix: this cell left the cache switched on." in printed
    if situation == "hooks it cannot read":  # one warning, and status says why, in the same words
        assert printed.count("PatchSkippedWarning: bnb-gc-fix is not in bitsandbytes") == 1, printed
        assert "bnb-gc-fix cannot read its hooks" in printed and "state: unprotected: " in printed
