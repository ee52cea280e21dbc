#!/usr/bin/env python3
"""A design experiment for issue 38 (not a gradkit optimizer): which form of the
4-bit second moment trains like float32 AdamW? Li et al. 2023 ("Memory Efficient
Optimizers with 4-bit States") recommend rank-1 normalisation on the linear map
without zero, and list per-block normalisation on the dynamic map without zero
(DE-0) among the forms that also avoid the zero point. This trains the tests'
SmallCNN and TinyGPT for 300 steps (the long training tests' setup:
python/tests/test_torch_low_bit.py) with

- torch.optim.AdamW, float32 moments (the reference);
- gradkit.torch.AdamW(moments="int4") (as built: v per block of 128 on DE-0);
- an emulation in torch of the same 4-bit AdamW, v per block on DE-0 (it should
  land where gradkit's does: the emulation is then trustworthy);
- the emulation with v per block on the linear map (i + 1) / 16 (gradkit's form
  before state format 4);
- the emulation with v normalised rank-1: v / min(row max, column max) of the
  tensor viewed as (dim 0, the rest), linear map, 1-D tensors per block, as the
  paper's default does.

The first moment is 4-bit blockwise (signed dynamic map, blocks of 128) in every
emulation; tensors of fewer than 4096 elements keep float32 moments, as
gradkit's min_4bit_size. Prints each run's mean loss over its last 25 steps
against torch's, and the CNN's held-out accuracy. CPU, about 2 minutes on 2 cores
per seed. The seed sets the initial weights and the batches.
usage: bench/int4_second_moment_emulation.py [--steps 300] [--seeds 0 1 2]
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
import models  # noqa: E402

M_CODES = torch.tensor(gradkit.quant_code4(gradkit.QuantCode.signed_dynamic))
DE0_CODES = torch.tensor(gradkit.quant_code4(gradkit.QuantCode.unsigned_dynamic))  # DE-0, as gradkit encodes
LINEAR_CODES = torch.arange(1, 17, dtype=torch.float32) / 16  # (i + 1) / 16


def nearest(x, codes):
    return codes[(x.unsqueeze(-1) - codes).abs().argmin(-1)]


def blockwise(x, codes, block=128):
    """x encoded and decoded: each block of 128 by its absmax."""
    flat = x.reshape(-1)
    n = flat.numel()
    f = torch.cat([flat, flat.new_zeros((-n) % block)]).view(-1, block)
    amax = f.abs().amax(1, keepdim=True)
    return (nearest(f / torch.where(amax > 0, amax, torch.ones_like(amax)), codes) * amax).reshape(-1)[:n].view_as(x)


def rank1(v, codes):
    """v (>= 0) encoded and decoded with the rank-1 normaliser min(row max, column max)."""
    if v.dim() < 2:
        return blockwise(v, codes)
    m = v.reshape(v.shape[0], -1)
    s = torch.minimum(m.amax(1, keepdim=True), m.amax(0, keepdim=True))
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return (nearest((m / safe).clamp(max=1), codes) * torch.where(s > 0, s, torch.zeros_like(s))).view_as(v)


class EmulatedAdamW4(torch.optim.Optimizer):
    """AdamW whose moments are stored 4-bit (encoded after each update, decoded values kept)."""

    def __init__(self, params, second_moment, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.second_moment = second_moment

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                s = self.state[p]
                if not s:
                    s.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                s["t"] += 1
                m = s["m"] * b1 + (1 - b1) * p.grad
                v = s["v"] * b2 + (1 - b2) * p.grad * p.grad
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(-(g["lr"] / (1 - b1 ** s["t"])) * m / ((v / (1 - b2 ** s["t"])).sqrt() + g["eps"]))
                if p.numel() >= 4096:
                    m = blockwise(m, M_CODES)
                    v = (rank1(v, LINEAR_CODES) if self.second_moment == "rank-1, linear"
                         else blockwise(v, DE0_CODES if self.second_moment == "per block, DE-0" else LINEAR_CODES))
                s["m"], s["v"] = m, v


def train(kind, make, steps, seed=0):
    torch.manual_seed(seed)
    model, batches = ((models.SmallCNN(), models.image_batches) if kind == "cnn"
                      else (models.TinyGPT(), models.text_batches))
    opt = make(model.parameters())
    losses = []
    for x, y in batches("cpu", steps, seed=seed):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    accuracy = models.held_out_accuracy(model, "cpu", torch.float32) if kind == "cnn" else None
    return float(np.mean(losses[-25:])), accuracy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    runs = {"torch.optim.AdamW, float32": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
            "gradkit AdamW int4 (v per block, DE-0)": lambda p: gt.AdamW(p, lr=1e-3, weight_decay=0.01,
                                                                         moments="int4"),
            "emulated int4, v per block, DE-0": lambda p: EmulatedAdamW4(p, "per block, DE-0"),
            "emulated int4, v per block, linear": lambda p: EmulatedAdamW4(p, "per block, linear"),
            "emulated int4, v rank-1, linear": lambda p: EmulatedAdamW4(p, "rank-1, linear")}
    print(f"torch {torch.__version__}, {args.steps} steps, mean loss of the last 25")
    for seed in args.seeds:
        for kind in ("cnn", "gpt"):
            base = None
            for name, make in runs.items():
                final, accuracy = train(kind, make, args.steps, seed)
                base = base or final
                held = f", held-out accuracy {100 * accuracy:.2f}%" if accuracy is not None else ""
                print(f"seed {seed} {kind}  {name:38s} {final:.4f}  {100 * (final / base - 1):+.2f}%{held}",
                      flush=True)


if __name__ == "__main__":
    main()
