"""axolotl's 8-bit MoE expert path: experts quantized by ``replace_parameter_8bit``; one JSON line per step.

Run as a script in a fresh interpreter by the tests, with the axolotl wheel first on ``PYTHONPATH``:

    python tests/scenarios/axolotl_moe8bit.py --steps 4 [--layers 3] [--import-fix] [--no-checkpointing]
        [--bitsandbytes-first] [--log]

Each layer has a trainable router and an experts module with two 2-D expert weights that axolotl's
``axolotl.monkeypatch.moe_quant.replace_parameter_8bit`` quantizes to int8 (bitsandbytes' CPU int8
quantizer takes 2-D tensors; axolotl's loader quantizes 3-D CUDA tensors, with the same hooks). Each
layer runs under non-reentrant activation checkpointing, whose recompute stops early inside the
experts' forward; AdamW trains the routers. It imports ``bnb_gc_fix`` only with ``--import-fix``,
so the start-up hook is tested with an unchanged script. The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import logging
import sys

import report


def build(layers: int = 3, hidden: int = 32, experts: int = 4):  # type: ignore[no-untyped-def]
    """The model: ``layers`` checkpointable layers whose expert weights axolotl quantizes to int8."""
    import torch
    from axolotl.monkeypatch.moe_quant import replace_parameter_8bit
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(experts * hidden, hidden) * 0.05)
            self.down_proj = nn.Parameter(torch.randn(hidden, experts * hidden) * 0.05)

        def forward(self, x, weights):  # type: ignore[no-untyped-def]
            h = torch.nn.functional.silu(x @ self.gate_up_proj.t())
            # The routing weights enter last, so the last tensor checkpointing saves is made here:
            # its recompute stops inside this forward, after the cache was switched on.
            h = h * weights.repeat_interleave(hidden, dim=-1)
            return h @ self.down_proj.t()

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(hidden, experts)
            self.experts = Experts()

        def forward(self, x):  # type: ignore[no-untyped-def]
            weights = torch.softmax(self.router(x), dim=-1)
            return x + self.experts(x, weights)

    torch.manual_seed(0)
    model = nn.ModuleList(Layer() for _ in range(layers))
    for layer in model:
        replace_parameter_8bit(layer.experts, "gate_up_proj")
        replace_parameter_8bit(layer.experts, "down_proj")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".router." in f".{name}")
    return model


def hook_counts(model) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The first experts module's forward pre-hooks and forward hooks, and how many of those are
    always-called (axolotl's own pair before 0.20: none; where the fix took it over: its one)."""
    experts = model[0].experts
    return {
        "pre_hooks": len(experts._forward_pre_hooks),
        "hooks": len(experts._forward_hooks),
        "always_called": len(experts._forward_hooks_always_called),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--import-fix", action="store_true")
    parser.add_argument(
        "--bitsandbytes-first",
        action="store_true",
        help="import bitsandbytes before axolotl (default: moe_quant first, which imports bitsandbytes "
        "itself, so the start-up hook fires while moe_quant is half-initialised)",
    )
    parser.add_argument("--log", action="store_true", help="print bnb_gc_fix's log lines to stdout")
    args = parser.parse_args()

    if args.log:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("LOG %(name)s: %(message)s"))
        logging.getLogger("bnb_gc_fix").addHandler(handler)
        logging.getLogger("bnb_gc_fix").setLevel(logging.DEBUG)
    if args.import_fix:
        import bnb_gc_fix  # noqa: F401
    if args.bitsandbytes_first:
        import bitsandbytes
    bitsandbytes_before = "bitsandbytes" in sys.modules
    import axolotl
    import axolotl.monkeypatch.moe_quant
    import bitsandbytes
    import torch
    from torch.utils.checkpoint import checkpoint

    model = build(layers=args.layers)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    for step in range(args.steps):
        h = x
        for layer in model:
            h = layer(h) if args.no_checkpointing else checkpoint(layer, h, use_reentrant=False)
        loss = h.pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        report.emit({"step": step, "loss": float(loss.item()), **report.cache_state()})
    summary: dict[str, object] = {
        "axolotl": axolotl.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "hooks": hook_counts(model),
        "bitsandbytes_before_moe_quant": bitsandbytes_before,
    }
    fix = sys.modules.get("bnb_gc_fix")
    if fix is not None:
        summary["libraries"] = [
            {
                "name": lib.name,
                "version": lib.version,
                "hooks": lib.hooks,
                "fixed": lib.fixed,
                "state": lib.state,
                "reason": lib.reason,
            }
            for lib in getattr(fix.status(), "libraries", ())
        ]
    report.finish(summary)


if __name__ == "__main__":
    main()
