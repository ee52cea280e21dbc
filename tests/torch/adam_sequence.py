#!/usr/bin/env python3
"""Runs torch.optim.Adam / AdamW over a gradient sequence that a gradkit test
wrote, and writes the final weights back, for the test to compare.

usage: adam_sequence.py DIR
DIR/config.txt: "<optimizer> <impl> <device> <steps> <lr> <beta1> <beta2> <eps> <weight_decay> <amsgrad> <sizes...>"
DIR/w0.bin: the initial weights (f32, tensors back to back)
DIR/grads.bin: steps x the same layout of f32 gradients
Writes DIR/w_torch.bin (the implementation asked for) and DIR/w_torch_other.bin
(fused if foreach was asked for, and the reverse), so that the test can show
how far PyTorch's own implementations are from each other. Exit 3 if torch
is not importable.
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
    name, impl, device, steps = words[0], words[1], words[2], int(words[3])
    lr, beta1, beta2, eps, wd = (float(x) for x in words[4:9])
    amsgrad = words[9] == "1"
    sizes = [int(x) for x in words[10:]]
    total = sum(sizes)
    w0 = np.fromfile(f"{d}/w0.bin", dtype=np.float32)
    grads = np.fromfile(f"{d}/grads.bin", dtype=np.float32).reshape(steps, total)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam

    def run(implementation):
        params, offset = [], 0
        for n in sizes:
            params.append(torch.tensor(w0[offset:offset + n], device=device, requires_grad=True))
            offset += n
        kwargs = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, amsgrad=amsgrad)
        kwargs[implementation] = True
        opt = cls(params, **kwargs)
        for s in range(steps):
            offset = 0
            for p, n in zip(params, sizes):
                p.grad = torch.tensor(grads[s, offset:offset + n], device=device)
                offset += n
            opt.step()
        return torch.cat([p.detach().cpu() for p in params]).numpy().astype(np.float32)

    run(impl).tofile(f"{d}/w_torch.bin")
    run("foreach" if impl == "fused" else "fused").tofile(f"{d}/w_torch_other.bin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
