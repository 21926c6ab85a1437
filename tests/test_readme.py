"""The documentation cannot drift from the code: the README's Quick start commands are the ones
``.ci/run`` runs, its first screen says who is affected in a user's words and its table the releases the
package states, it explains every state word status can print, the matrix table is
rendered from the committed results, and every console block of README.md and docs/*.md is what its
commands print now. This file is where the console blocks are checked (``scripts/readme_table.py --check``
checks the matrix): each ``bnb-gc-fix`` command is the same run test_command_line.py reads (conftest's
``command``), each ``python -c`` command runs forked from the warm parent where it imports torch or
bitsandbytes, in a fresh interpreter where it imports neither."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, command, environment, run_python, unwrapped

sys.path.insert(0, str(ROOT / "scripts"))
import readme_table

BLOCKS = [
    (document, name)
    for document in readme_table.documents()
    for name in readme_table.console_blocks(document.read_text())
]


def test_ci_runs_the_readme_quick_start_commands_exactly() -> None:
    readme, ci = readme_table.quick_start_commands(), readme_table.ci_commands()
    assert readme and readme == ci, (readme, ci)


def _releases() -> dict[str, tuple[str, str]]:
    """Each library's first affected and first fixed release, as the package states them (read in a
    fresh interpreter, from the module the start-up hook loads)."""
    code = (
        "import json; from bnb_gc_fix.libraries import LIBRARIES; "
        "print(json.dumps({l.name: [l.first_affected, l.first_fixed] for l in LIBRARIES}))"
    )
    found = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    return {name: (first, fixed) for name, (first, fixed) in found.items()}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_the_readmes_who_is_affected_says_the_releases_the_package_states() -> None:
    said = unwrapped((ROOT / "README.md").read_text().split("## Fix it")[0])
    releases = _releases()
    first, fixed = releases["bitsandbytes"]
    assert f"bitsandbytes {first}-" in said, said
    major, minor = _minor(fixed)
    assert f"bitsandbytes {major}.{minor} or later" in said, said
    first, fixed = releases["axolotl"]
    (major, minor), (_, fixed_minor) = _minor(first), _minor(fixed)
    assert f"axolotl {major}.{minor}-{major}.{fixed_minor - 1}'s 8-bit experts" in said, said


def test_the_readmes_first_screen_says_who_is_affected_in_the_users_words() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    for words in (
        "replace_parameter_4bit",  # what quantizes the affected experts
        "quantize_moe_experts",
        "BitsAndBytesConfig",  # what does not
        "gradient_checkpointing_enable()",  # both spellings of the switch
        "activation_checkpointing_enable()",
        "CheckpointError",  # the symptoms
        "out-of-memory",
        "pip install .",  # the fix, and how to tell it worked
        "bnb-gc-fix check",
    ):
        assert words in first_screen, words
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150  # the details are in docs/


def test_the_readme_explains_every_state_word_status_can_print() -> None:
    code = "import sys, bnb_gc_fix; print('\\n'.join(sys.modules['bnb_gc_fix.status'].STATES))"
    states = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.splitlines()
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")]
    explained = [row.split("|")[1].strip() for row in rows]  # the first column of the table of states
    assert states, "status.STATES could not be read"
    for state in states:
        assert f"`{state}`" in explained, (state, explained)


def test_the_matrix_table_is_rendered_from_the_committed_results() -> None:
    page = readme_table.MATRIX_PAGE.read_text()
    table = readme_table.render(json.loads(readme_table.MATRIX.read_text()))
    assert table in page, "docs/matrix.md's table is not docs/matrix.json's: run scripts/readme_table.py"


def test_the_matrix_check_lets_a_newer_release_resolved_at_run_time_pass_and_nothing_else() -> None:
    committed = json.loads(readme_table.MATRIX.read_text())
    floating = next(c for c in committed["cells"] if c["cell"].get("transformers") == "*")
    newer = copy.deepcopy(committed)
    worse = copy.deepcopy(committed)
    for matrix in (newer, worse):
        cell = next(c for c in matrix["cells"] if c["cell"]["name"] == floating["cell"]["name"])
        cell["versions"]["transformers"] = "99.0.0"
    next(c for c in worse["cells"] if c["cell"]["name"] == floating["cell"]["name"])["verdict"] = "FAIL"
    assert readme_table._table_matches(committed)
    assert readme_table._table_matches(newer)  # a release published since: same outcomes, no red CI
    assert not readme_table._table_matches(worse)


def test_every_console_block_is_generated() -> None:
    names = {name for _, name in BLOCKS}
    assert {"check-output", "status-output", "api-output"} <= names, names
    for document in readme_table.documents():
        assert not readme_table.ungenerated_console_fences(document.read_text()), document


def _printed(line: str, previous: int) -> tuple[int, list[str]]:
    """What a console block's command prints (stdout, then stderr, without the lines torch and
    bitsandbytes print on their own), and its exit code; ``previous`` is the one before (``echo $?``)."""
    if line == "echo $?":
        return previous, [str(previous)]
    words = shlex.split(line)
    settings = [word for word in words if "=" in word.split(" ")[0] and word[:1].isupper()]
    switches = dict(setting.split("=", 1) for setting in settings)
    program, *args = words[len(settings) :]
    assert set(switches) <= {"BNB_GC_FIX"}, f"a console block's command sets {switches}"
    switch = switches.get("BNB_GC_FIX")
    if program == "bnb-gc-fix":
        code, out, err = command(*args, switch=switch)
    else:
        assert program == "python" and args[0] == "-c", f"a console block runs {program} {args[:1]}"
        imports_torch = "torch" in args[1] or "bitsandbytes" in args[1]
        fresh = None if imports_torch else "a command that imports neither torch nor bitsandbytes"
        run = run_python(args, env=environment(switch), fresh=fresh)
        code, out, err = run.returncode, run.stdout, run.stderr
    printed = (out + err).splitlines()
    return code, [line for line in printed if not any(noise in line for noise in readme_table.FOREIGN)]


def _console_now(block: str) -> str:
    """The console block's commands, and what each prints now."""
    lines, previous = [], 0
    for command_line in [line[2:] for line in block.splitlines() if line.startswith("$ ")]:
        previous, printed = _printed(command_line, previous)
        lines += [f"$ {command_line}", *printed]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("document", "name"), BLOCKS, ids=[f"{document.name}:{name}" for document, name in BLOCKS]
)
def test_console_block_is_what_its_commands_print(document: Path, name: str) -> None:
    recorded, here = readme_table.recorded_environment(), readme_table.environment()
    if recorded != here:
        pytest.skip(
            f"the console blocks were generated with {recorded}, this environment is {here}: they are "
            "compared in the Quick start's environment (constraints.txt; CI runs it)"
        )
    for committed in readme_table.fences(document.read_text(), name):
        now = _console_now(committed)
        assert readme_table.comparable(committed) == readme_table.comparable(now), (
            f"{document.name}'s {name} is not what its commands print now; run scripts/readme_table.py\n"
            + readme_table.show_diff(document, committed, now)
        )
