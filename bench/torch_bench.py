#!/usr/bin/env python3
"""PyTorch's side of `gradkit bench`: the same operations on the same tensor
lists, timed the same way (median over repetitions, CUDA events on a GPU).

Reads one case per line from --cases: "<op> <workload words...> <sizes...>"
where the sizes are the trailing integers; prints "case <index> <ms>" lines.
"""
import argparse
import sys

import timing  # bench/timing.py, next to this script


def parse_cases(path):
    cases = []
    with open(path) as f:
        for line in f:
            words = line.split()
            if not words:
                continue
            sizes = []
            while words and words[-1].isdigit():
                sizes.append(int(words.pop()))
            sizes.reverse()
            cases.append((words[0], sizes))
    return cases


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("torch not importable", file=sys.stderr)
        return 3
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    def median_ms(fn):
        return timing.median_ms(fn, args.reps, cuda=cuda)

    for index, (op, sizes) in enumerate(parse_cases(args.cases)):
        gen = torch.Generator(device=device).manual_seed(index)
        bufs = [torch.rand(n, device=device, generator=gen) * 2 - 1 for n in sizes]
        if op == "zero":
            fn = (lambda: bufs[0].zero_()) if len(bufs) == 1 else (lambda: torch._foreach_zero_(bufs))
        elif op == "accumulate":
            vals = [torch.rand(n, device=device, generator=gen) * 2 - 1 for n in sizes]
            fn = (lambda: bufs[0].add_(vals[0])) if len(bufs) == 1 else (lambda: torch._foreach_add_(bufs, vals))
        elif op == "adam":
            # torch.optim.AdamW(fused=True), the fastest step PyTorch ships,
            # where this PyTorch has it for the device (CUDA; the CPU from
            # 2.4); else its default step (PyTorch 1.13 has no fused AdamW).
            params = [torch.nn.Parameter(b) for b in bufs]
            for p in params:
                p.grad = torch.rand(p.numel(), device=device, generator=gen) * 2 - 1
            # On the CPU fused=True exists from PyTorch 2.4; before it, the
            # fastest there is foreach. The note says which one ran.
            try:
                opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
                opt.step()  # creates the state
                kind = "fused=True"
            except (RuntimeError, TypeError, ValueError):
                opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=True)
                opt.step()
                kind = "foreach=True (this PyTorch has no fused AdamW on the CPU)"
            threads = f", {torch.get_num_threads()} threads" if not cuda else ""
            print(f"note case {index} adam: torch {torch.__version__} AdamW({kind}){threads}", flush=True)
            fn = opt.step
        elif op == "fp16-adam" and cuda:
            # PyTorch's AMP sequence after backward, as a user writes it:
            # GradScaler.unscale_, clip_grad_norm_(foreach), scaler.step(fused
            # AdamW), scaler.update(); f32 parameters and gradients.
            params = [torch.nn.Parameter(b) for b in bufs]
            grads = [torch.rand(p.numel(), device=device, generator=gen) * 2 - 1 for p in params]
            opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
            scaler = torch.amp.GradScaler("cuda", init_scale=1.0)

            loss = torch.ones((), device=device)

            def amp_step(params=params, grads=grads, opt=opt, scaler=scaler, loss=loss):
                scaler.scale(loss)  # as before backward; sets up the scaler's state
                for p, g in zip(params, grads):
                    p.grad = g
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                scaler.step(opt)
                scaler.update()

            amp_step()
            fn = amp_step
        else:
            # No PyTorch equivalent (e.g. adam-mixed: torch.optim keeps no
            # f32 master weights beside a bf16 model); leave the column empty.
            continue
        try:
            print(f"case {index} {median_ms(fn):.6f}", flush=True)
        except Exception as error:  # report it and go on with the other cases
            print(f"case {index} failed: {error}", file=sys.stderr, flush=True)
        del bufs
        if cuda:
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
