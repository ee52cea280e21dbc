#!/usr/bin/env python3
"""Host time of one optimizer step call over GPT-2 124M's 148 tensors on CUDA, beside
torch's fused AdamW in the same process: gradkit.torch.AdamW (float32 and int8 moments)
and AmpStep with clipping. The call's wall time on the host, the queue kept short (one
synchronization after each call, torch_step.py's host_us), the best of --rounds medians
of --reps calls.

To compare two versions of the Python package (a change's host cost), run it under each
in alternating processes, as bench/log/2026-12-01.md does; one process's figures move
with the host's load, so compare a round's pair, not runs far apart.

usage: bench/torch_step_host.py [LABEL] [--reps N] [--rounds N]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit.torch as gt  # noqa: E402
from torch_step import gpt2_shapes, host_us, make_params  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("label", nargs="?", default="gradkit")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("torch_step_host.py needs a CUDA device", file=sys.stderr)
        return 1
    best = lambda fn: min(host_us(fn, args.reps) for _ in range(args.rounds))  # noqa: E731
    for name, kwargs in (("AdamW", {}), ("AdamW int8", {"moments": "int8"})):
        opt = gt.AdamW(make_params(gpt2_shapes()), lr=1e-4, **kwargs)
        ref = torch.optim.AdamW(make_params(gpt2_shapes(), seed=1), lr=1e-4, fused=True)
        row = [f"{args.label} {name}: gradkit {best(opt.step):.1f} us", f"torch fused {best(ref.step):.1f} us"]
        if not kwargs:
            row.append(f"AmpStep (clip 1.0) {best(gt.AmpStep(opt, max_norm=1.0).step):.1f} us")
        print(" | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
