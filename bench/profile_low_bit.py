#!/usr/bin/env python3
"""Steps gradkit.torch.AdamW with 8-bit (or, with --int4, 4-bit) moments over
the GPT-2 124M list a few times: a target for Nsight Compute, to see where the
low-bit kernel's time goes. --remainder: bf16 weights with remainder masters.
usage: ncu --kernel-name "regex:AdamLowBitOp.*Codec8" --launch-skip 2 --launch-count 1 \\
           --set detailed python3 bench/profile_low_bit.py [--int4] [--remainder]
"""
import sys

import torch

import gradkit.torch as gt
from torch_step import gpt2_shapes, make_params


def main():
    params = make_params(gpt2_shapes())
    moments = "int4" if "--int4" in sys.argv else "int8"
    if "--remainder" in sys.argv:
        for p in params:
            p.data, p.grad = p.data.bfloat16(), p.grad.bfloat16()
        opt = gt.AdamW(params, moments=moments, master="remainder")
    else:
        opt = gt.AdamW(params, moments=moments)
    for _ in range(4):
        opt.step()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
