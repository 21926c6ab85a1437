"""How the package's printed text is shaped: lines of at most 100 characters, in the README's words (the
cache, the counter, the forwards that switched it on, the fix, on and off).

Every line that ``status``, ``check``, the safety nets and the warnings print goes through :func:`wrap`.
"""

from __future__ import annotations

import textwrap

WIDTH = 100
#: Where a wrapped line goes on: under the text after a label such as ``"state: "``.
INDENT = " " * 7

#: What status and the safety nets say of the switch-ons that the fix's own forwards do not account for.
NOT_THE_FIXS = (
    "bnb-gc-fix cannot tell what switched the cache on (a P.cached() block still open, a forward running "
    "on another thread or begun before the fix was on, bitsandbytes' own hooks where the fix is off). If "
    "nothing keeps the cache on on purpose, bnb_gc_fix.reset() switches it off once nothing runs."
)


def counted(number: int, thing: str) -> str:
    """``1 module``, ``2 modules``."""
    return f"{number} {thing}" if number == 1 else f"{number} {thing}s"


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
