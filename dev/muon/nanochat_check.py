#!/usr/bin/env python3
"""Does gradkit.torch.MuonAdamW step as nanochat's own MuonAdamW does? Both over the
same small nanochat-shaped parameters (bench/nanochat_optim.py: nanochat's GPT's
tensors and setup_optimizer's groups, bfloat16 embeddings) from the same weights,
fed the same seeded gradients for --steps steps, on the CPU; prints, per parameter,
the weights' largest difference relative to the largest weight change nanochat's
run made (max |w_gradkit - w_nanochat| / max |w_nanochat - w_0|) and norm-wise
(||w_gradkit - w_nanochat|| / ||w_nanochat - w_0||).

nanochat's optim.py is read from --nanochat-optim (extract it outside this
repository, e.g. git -C NANOCHAT show HEAD:nanochat/optim.py > /tmp/nanochat_optim.py);
its `nanochat.common` import is stubbed with COMPUTE_DTYPE = torch.bfloat16. Its
functions are torch.compile'd (inductor builds them with the host's g++ on the CPU);
TORCHDYNAMO_DISABLE=1 runs them eager.

What to expect: the AdamW groups' float32 parameters agree to float32 rounding; the
bfloat16 embeddings differ by bfloat16 rounding (nanochat steps them in bfloat16,
gradkit steps float32 masters). The Muon matrices differ by a few percent of their
change: eager nanochat rounds each term of the Newton-Schulz polynomial to bfloat16
on its own (b A, c (A A), a X, X B), whose roundings Polar Express's large first
coefficients amplify, where gradkit rounds once after each fused product as
torch.optim.Muon's addmm does (gradkit's result is the nearer to float64's);
compiled nanochat fuses those terms in float32 otherwise again.

usage: dev/muon/nanochat_check.py --nanochat-optim PATH [--steps N] [--depth D] [--vocab V]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import gradkit.torch as gt  # noqa: E402
from nanochat_optim import (clone_params, load_nanochat_optim, model_dim, nanochat_param_groups,  # noqa: E402
                            nanochat_params)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanochat-optim", required=True, help="the path of nanochat's nanochat/optim.py")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--aspect-ratio", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()

    nanochat = load_nanochat_optim(args.nanochat_optim)
    dim = model_dim(args.depth, args.aspect_ratio, args.head_dim)
    ours_params = nanochat_params(args.depth, args.vocab, args.aspect_ratio, args.head_dim)
    theirs_params = clone_params(ours_params)
    ours = gt.MuonAdamW(nanochat_param_groups(ours_params, dim))
    theirs = nanochat.MuonAdamW(nanochat_param_groups(theirs_params, dim))
    names = [f"{k}[{i}] {tuple(p.shape)} {str(p.dtype)[6:]}" for k, ps in ours_params.items() for i, p in enumerate(ps)]
    a = [p for ps in ours_params.values() for p in ps]
    b = [p for ps in theirs_params.values() for p in ps]
    start = [p.detach().clone() for p in b]
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        for p, q in zip(a, b):
            grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    print(f"torch {torch.__version__}, dynamo {'off' if os.environ.get('TORCHDYNAMO_DISABLE') == '1' else 'on'}, "
          f"depth {args.depth}, model_dim {dim}, vocab {args.vocab}, {args.steps} steps")
    print(f"{'parameter':<34} {'max rel':>10} {'norm rel':>10}")
    for name, p, q, w0 in zip(names, a, b, start):
        x, y, w0 = p.detach().double(), q.detach().double(), w0.double()
        moved = (y - w0)
        print(f"{name:<34} {((x - y).abs().max() / moved.abs().max()).item():10.2e} "
              f"{((x - y).norm() / moved.norm()).item():10.2e}")


if __name__ == "__main__":
    main()
