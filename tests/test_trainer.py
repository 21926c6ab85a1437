"""The Hugging Face Trainer with gradient checkpointing, as a user runs it (the script never imports the
package): the fix keeps the counter at 0 after every step; the control (the fix off) leaks."""

from __future__ import annotations

import pytest
from conftest import AFFECTED, SCENARIOS, run_python

pytestmark = pytest.mark.usefixtures("startup_hook_installed")


@pytest.mark.stack
def test_a_trainer_run_ends_every_step_with_the_cache_off() -> None:
    result = run_python([str(SCENARIOS / "trainer.py")])
    assert result.returncode == 0, result.stderr[-3000:]
    state = "protected" if AFFECTED else "not affected"
    assert result.last_json == {"counters": [0, 0, 0, 0], "state": state, "fixed": AFFECTED}


@pytest.mark.stack
def test_a_trainer_run_control_switched_off_leaks() -> None:
    result = run_python([str(SCENARIOS / "trainer.py")], switch="0")
    assert result.returncode == 0, result.stderr[-3000:]
    counters = result.last_json["counters"]
    assert result.last_json["state"] is result.last_json["fixed"] is None  # the package was never imported
    if AFFECTED:
        assert counters[-1] > counters[0] > 0
    else:  # upstream's fix: no leak without the package either
        assert counters == [0, 0, 0, 0]
