"""cloudpickle and dill (Ray, joblib's loky, dill's users) carry a gated module as plain pickle does.

Those libraries save a bound method as (function, object), by reference to the function's module, where
plain pickle calls the method's own reduction. So a gate whose hooks were bound methods of
``bnb_gc_fix.gate`` loaded, there, as the gate's function bound to bitsandbytes' module: an
``AttributeError`` on every forward where the package is active, a ``ModuleNotFoundError`` where it
is not installed. The rule for every hostile host: where the control (``BNB_GC_FIX=0`` when saving)
loads and runs, the fixed module loads and runs too, and behaves as the control does in that
interpreter: protected where the fix is active, bitsandbytes' own pair where it is not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import AFFECTED, FIX, run_code

pytestmark = pytest.mark.usefixtures("startup_hook_installed")

PICKLERS = ("cloudpickle", "dill")

# A gated module exported as users save one: float weights, the hooks still on the module; saved once
# with each pickler into the folder sys.argv[1].
SAVE = """
import importlib
import torch
import torch.nn.utils.parametrize as P
import quantized
module = quantized.make(params=2)
torch.__future__.set_swap_module_params_on_conversion(True)  # a 4-bit weight becomes a float one
for name in module.names:
    P.remove_parametrizations(module, name, leave_parametrized=True)
for pickler in sys.argv[2:]:
    with open(f"{sys.argv[1]}/{pickler}.pkl", "wb") as file:
        importlib.import_module(pickler).dump(module, file)
"""

# Where bnb-gc-fix is not installed: its package cannot be imported at all.
NOT_INSTALLED = """
import sys
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("bnb_gc_fix", "_bnb_gc_fix"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
"""

# Load each file named in sys.argv[1:] and train 3 checkpointed steps with it; one JSON line: for each
# file, what happened.
LOAD = """
import importlib
import torch
import quantized
def train(path):
    pickler = importlib.import_module(path.rsplit("/", 1)[-1].split(".")[0])
    with open(path, "rb") as file:
        module = pickler.load(file)
    counters, error = [], None
    try:
        counters = quantized.checkpointed_counters(module)
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    hooks = sorted({getattr(h, "__module__", "?").split(".")[0] for h in module._forward_pre_hooks.values()})
    quantized.reset()
    return {"counters": counters, "error": error, "hooks": hooks}
runs = {path: train(path) for path in sys.argv[1:]}
print(json.dumps({"runs": runs, "fix": "bnb_gc_fix" in sys.modules}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folder of one file per pickler of a module saved with the fix ("fixed"), and one of a module
    saved as the control ("control")."""
    folders = {}
    for side, switch in (("fixed", FIX), ("control", "0")):
        folder = tmp_path_factory.mktemp(side)
        run_code(SAVE, str(folder), *PICKLERS, prelude="scenarios", switch=switch)
        folders[side] = folder
    return folders


def _load(where: str, files: list[Path]) -> dict[str, Any]:
    """Load and train each file in one fresh interpreter: ``where`` the fix is "active", switched
    "off", or "not installed"."""
    switch = {"active": FIX, "off": "0", "not installed": "0"}[where]
    code = NOT_INSTALLED + LOAD if where == "not installed" else LOAD
    result = run_code(code, *map(str, files), prelude="scenarios", switch=switch)
    return dict(result.last_json)


@pytest.mark.parametrize("where", ["active", "off", "not installed"])
def test_a_module_saved_with_the_fix_loads_and_runs_where_the_control_does(
    saved: dict[str, Path], where: str
) -> None:
    files = [saved[side] / f"{pickler}.pkl" for side in ("fixed", "control") for pickler in PICKLERS]
    loaded = _load(where, files)
    assert loaded["fix"] is (where == "active")
    for pickler in PICKLERS:
        fixed = loaded["runs"][str(saved["fixed"] / f"{pickler}.pkl")]
        control = loaded["runs"][str(saved["control"] / f"{pickler}.pkl")]
        assert fixed["error"] is None and control["error"] is None, pickler
        assert fixed["hooks"] == control["hooks"], pickler
        if where == "active":
            # A plain pair becomes the gate at its first forward: one pre-hook, ours, and no leak.
            assert fixed["hooks"] == ["bnb_gc_fix"], pickler
            assert fixed["counters"] == control["counters"] == [0, 0, 0], pickler
        elif AFFECTED:
            # bitsandbytes' own pair, as the control has it, and it leaks; one pair where the control
            # has one a parameter (the gate had folded them into one), so it leaks no faster.
            assert fixed["hooks"] == ["bitsandbytes"], pickler
            assert fixed["counters"][-1] > fixed["counters"][0] > 0, pickler
            assert all(f <= c for f, c in zip(fixed["counters"], control["counters"])), pickler
        else:
            assert fixed["hooks"] == ["bitsandbytes"], pickler
            assert fixed["counters"] == control["counters"] == [0, 0, 0], pickler
