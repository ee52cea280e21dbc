#!/usr/bin/env python3
"""What an optimizer's first step allocates on the GPU, block by block: the
blocks torch's caching allocator holds after the step that it did not hold
before, their requested bytes (what the optimizer asked for) against their
size (what torch.cuda.memory_allocated() counts), per parameter of the
GPT-2 list (bench/torch_step.py's shapes). It tells state that the
optimizer keeps from the allocator's rounding of it.
usage: bench/state_allocations.py [--list gpt2] [--moments int8,int4]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit.torch as gt  # noqa: E402
from torch_step import LISTS, make_params  # noqa: E402


def active_blocks():
    """(segment address, block offset) -> (size, requested size) of every allocated block."""
    out = {}
    for segment in torch.cuda.memory_snapshot():
        at = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                out[at] = (block["size"], block.get("requested_size", block["size"]))
            at += block["size"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", default="gpt2")
    ap.add_argument("--moments", default="float32,int8,int4")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/state_allocations.py needs a CUDA device")
    name, shapes_fn = LISTS[args.list]
    params = make_params(shapes_fn())
    numel = sum(p.numel() for p in params)
    print(f"{name}: {len(params)} tensors, {numel / 1e6:.1f}M parameters; torch {torch.__version__}")
    print(f"{'moments':>8} {'blocks':>6} {'requested B/param':>18} {'allocated B/param':>18} "
          f"{'memory_allocated delta':>23} {'state_bytes()':>14}")
    for moments in args.moments.split(","):
        torch.cuda.synchronize()
        before, allocated = active_blocks(), torch.cuda.memory_allocated()
        opt = gt.AdamW(params, lr=1e-4, moments=moments)
        opt.step()
        torch.cuda.synchronize()
        after = active_blocks()
        new = [after[k] for k in after.keys() - before.keys()]
        size, requested = sum(s for s, _ in new), sum(r for _, r in new)
        delta = torch.cuda.memory_allocated() - allocated
        print(f"{moments:>8} {len(new):>6} {requested / numel:>18.3f} {size / numel:>18.3f} {delta / numel:>23.3f} "
              f"{opt.state_bytes() / numel:>14.3f}")
        worst = sorted(new, key=lambda b: b[0] - b[1], reverse=True)[:3]
        print("          largest roundings (size, requested): " + ", ".join(f"({s}, {r})" for s, r in worst))
        del opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
