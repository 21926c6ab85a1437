"""The memory benchmark on CUDA (benchmarks/README.md, "CUDA"): ``memory.py --device cuda``, whose result
adds ``memory_allocated`` after the last step and ``max_memory_allocated`` per step. Options it does not
know go to memory.py. (The full size on a GPU: ``olmoe_full.py --device cuda``.)

    python benchmarks/gpu.py                   # results/memory-cuda.md
    python benchmarks/gpu.py --device cpu      # smoke run without a GPU (quick sizes, results/tmp/)
"""

from __future__ import annotations

import sys

import _harness as harness
import memory


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    args, forwarded = parser.parse_known_args(argv)
    if not harness.is_cuda(args.device):
        memory.main(["--device", args.device, "--quick", "--output", str(harness.RAW / "gpu-smoke.json")])
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device is available; use --device cpu for a smoke run", file=sys.stderr)
        return 2
    memory.main(["--device", args.device, *forwarded])
    return 0


if __name__ == "__main__":
    sys.exit(main())
