#!/usr/bin/env python3
"""PyTorch's AMP step after backward over a sequence a gradkit test wrote:
GradScaler.unscale_ + clip_grad_norm_ + scaler.step(AdamW) + scaler.update().

usage: amp_sequence.py DIR
DIR/config.txt: "<steps> <lr> <weight_decay> <max_norm> <init_scale> <growth_interval> <sizes...>"
DIR/w0.bin: initial f32 master weights; DIR/base.bin: steps x f32 unscaled gradients
DIR/poison.txt: one "<step> <index> <value>" per line (inf, -inf, nan)
At step s the gradient PyTorch sees is float16(scale_s * base_s), upcast, as
backward of a scaled f16 loss would produce. Writes DIR/w_torch.bin and
DIR/scales.txt (the scale before each step, then after the last).
"""
import sys

import numpy as np


def main():
    try:
        import torch
    except ImportError:
        return 3
    d = sys.argv[1]
    words = open(f"{d}/config.txt").read().split()
    steps, lr, wd, max_norm, init_scale, interval = (
        int(words[0]), float(words[1]), float(words[2]), float(words[3]), float(words[4]), int(words[5]))
    sizes = [int(x) for x in words[6:]]
    total = sum(sizes)
    w0 = np.fromfile(f"{d}/w0.bin", dtype=np.float32)
    base = np.fromfile(f"{d}/base.bin", dtype=np.float32).reshape(steps, total)
    poison = {}
    for line in open(f"{d}/poison.txt"):
        s, i, v = line.split()
        poison[(int(s), int(i))] = float(v)
    params, offset = [], 0
    for n in sizes:
        params.append(torch.nn.Parameter(torch.tensor(w0[offset:offset + n], device="cuda")))
        offset += n
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=interval)
    scales = []
    loss = torch.ones((), device="cuda")
    for s in range(steps):
        scaler.scale(loss)  # what a training step does before backward; it also sets up the scaler's state
        scale = scaler.get_scale()
        scales.append(scale)
        g = (base[s] * np.float32(scale)).astype(np.float16)
        for (ps, i), v in poison.items():
            if ps == s:
                g[i] = v
        g = torch.tensor(g.astype(np.float32), device="cuda")
        offset = 0
        for p, n in zip(params, sizes):
            p.grad = g[offset:offset + n].clone()
            offset += n
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        scaler.step(opt)
        scaler.update()
    scales.append(scaler.get_scale())
    torch.cat([p.detach().cpu() for p in params]).numpy().astype(np.float32).tofile(f"{d}/w_torch.bin")
    open(f"{d}/scales.txt", "w").write("\n".join(repr(x) for x in scales))
    return 0


if __name__ == "__main__":
    sys.exit(main())
