"""The libraries whose modules may register the leaking pair of hooks, and what the package says of each.

The modules' names are the start-up hook's (``_bnb_gc_fix.WATCHED``, said once there); everything else
lives here, imported with the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import _bnb_gc_fix as startup


@dataclass(frozen=True)
class Library:
    """A library whose module may register the leaking pair of hooks on the modules it quantizes. What the
    pair does is read from the library's code when its module is imported (``bnb_gc_fix.reading``); the
    releases named here are what the README states, never what the fix decides from."""

    name: str
    module_name: str  # the module whose code registers the pair
    register_name: str  # the name of that module's function that registers the pair
    quantizer_name: str  # the name of what users call, which calls that function
    first_affected: str  # the first release that registers the leaking pair
    first_fixed: str  # the first release whose "off" hook runs when a forward raises


BITSANDBYTES = Library(
    name="bitsandbytes",
    module_name=startup.WATCHED[0],
    register_name="_register_parametrization_hooks",
    quantizer_name="replace_parameter_4bit",
    first_affected="0.48.0",
    first_fixed="0.50.0",
)
AXOLOTL = Library(  # its 8-bit MoE experts carry a copy of bitsandbytes' pair
    name="axolotl",
    module_name=startup.WATCHED[1],
    register_name="replace_parameter_8bit",
    quantizer_name="quantize_moe_experts",
    first_affected="0.15.0",
    first_fixed="0.20.0",
)
LIBRARIES = (BITSANDBYTES, AXOLOTL)
