"""sitecustomize used by ``bnb-gc-fix run``: install the start-up hook, then load the user's own.

The runner puts this directory first on ``PYTHONPATH``, so Python imports this file as
``sitecustomize`` at start-up. It must print nothing and raise nothing of its own.
"""

import os
import sys


def _load_users_sitecustomize() -> None:
    """Find another ``sitecustomize`` further down ``sys.path`` and execute it under that name."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from importlib.machinery import PathFinder

        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = PathFinder.find_spec("sitecustomize", path)
    except Exception:
        return
    if spec is None or spec.loader is None:
        return
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # the user's own errors surface as they would without us


try:
    from _bnb_gc_fix import VIA_RUNNER
    from _bnb_gc_fix.startup import install_quietly
except Exception:
    pass
else:
    install_quietly(via=VIA_RUNNER)
_load_users_sitecustomize()
