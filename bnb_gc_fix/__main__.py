"""``python -m bnb_gc_fix``: the same command line as ``bnb-gc-fix``."""

from bnb_gc_fix.cli import main

raise SystemExit(main())
