"""How the package's printed text is shaped: lines of at most 100 characters, in the README's words (the
cache, the counter, the forwards that switched it on, the fix, on and off).

Every line that ``status``, ``check``, a notebook cell's report and the warnings print goes through
:func:`wrap`.
"""

from __future__ import annotations

import textwrap

WIDTH = 100
#: Where a wrapped line goes on: under the text after a label such as ``"state: "``.
INDENT = " " * 7


def counted(number: int, thing: str) -> str:
    """``1 module``, ``2 modules``."""
    return f"{number} {thing}" if number == 1 else f"{number} {thing}s"


def possessive(name: str) -> str:
    """``axolotl's``, ``bitsandbytes'``."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def wrap(text: str, indent: str = INDENT, width: int = WIDTH) -> str:
    """``text`` in lines of at most ``width`` characters, each after the first indented by ``indent``;
    never breaks a word (a word longer than a line stays whole)."""
    return textwrap.fill(
        text, width=width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def labelled(label: str, text: str) -> str:
    """``label: text``, wrapped under the text (``"state", "..."`` gives ``"state: ..."``)."""
    head = f"{label}:".ljust(len(INDENT) - 1) + " "
    return wrap(head + text, indent=" " * len(head))


def message(headline: str, details: str) -> str:
    """A warning's or a report's text: a short headline, then the details wrapped under it."""
    return f"{headline}\n  " + wrap(details, indent="  ", width=WIDTH - 2)
