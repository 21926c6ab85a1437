"""The README cannot drift from CI: its Quick start commands are the ones ``.ci/run`` runs, and its
console blocks are generated (these tests read files only; CI regenerates the output)."""

from __future__ import annotations

import re
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import readme_table

# --- the README's commands and real output (files only; CI regenerates the output) ---------------


def test_ci_runs_the_readme_quick_start_commands_exactly() -> None:
    readme, ci = readme_table.quick_start_commands(), readme_table.ci_commands()
    assert readme and readme == ci, (readme, ci)


def test_readme_examples_are_generated_console_blocks() -> None:
    blocks = readme_table.console_blocks((ROOT / "README.md").read_text())
    assert {"check-output", "status-output", "api-output"} <= set(blocks)
    for name, commands in blocks.items():
        assert commands, name
        assert all(re.match(r"^[A-Za-z_=0-9 ]*(bnb-gc-fix|python|echo)\b", c) for c in commands), commands
