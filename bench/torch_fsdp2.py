#!/usr/bin/env python3
"""FSDP2 (fully_shard) training step of a GPT-2-small-shaped transformer
(12 layers, width 768, 12 heads, vocabulary 256 bytes, 512 tokens) under
torchrun, with gradkit.torch.AdamW against torch's AdamW(fused=True) and
AdamW(foreach=True), in the same run:

    torchrun --nproc-per-node 2 bench/torch_fsdp2.py [--reps N] [--rounds R] [--batch B] [--markdown FILE]

Two figures per optimizer: the optimizer's step() alone over the local
shards (CUDA events around step(), after a backward whose gradients it
reads), and the whole step (zero_grad + forward + backward + step, bf16
autocast). Each case's median of --reps, the best of --rounds interleaved
rounds; rank 0 prints. The bytes moved by the step are 28 per local f32
parameter (read w, g, m, v; write w, m, v).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, "..", "python", "tests")]
import gradkit.torch as gt  # noqa: E402
import models  # noqa: E402
from timing import median_ms  # noqa: E402

OPTIMIZERS = {
    "gradkit AdamW": lambda p: gt.AdamW(p, lr=1e-4),
    "torch AdamW(fused=True)": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
    "torch AdamW(foreach=True)": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
}


def case(name, device, batch, block):
    torch.manual_seed(0)
    model = models.TinyGPT(layers=12, d=768, heads=12, block=block).to(device)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = OPTIMIZERS[name](model.parameters())
    x, y = next(models.text_batches(device, 1, batch=batch, block=block, seed=dist.get_rank()))

    def backward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()

    def whole():
        opt.zero_grad()
        backward()
        opt.step()

    backward()
    local = sum(p.to_local().numel() for p in model.parameters())
    return model, opt, whole, local


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    index = int(os.environ.get("GRADKIT_TEST_CUDA_DEVICE", os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    best = {}
    for _ in range(args.rounds):
        for name in OPTIMIZERS:
            model, opt, whole, local = case(name, device, args.batch, args.block)
            step_ms = median_ms(opt.step, args.reps)
            whole_ms = median_ms(whole, args.reps)
            old = best.get(name)
            best[name] = (min(step_ms, old[0]) if old else step_ms, min(whole_ms, old[1]) if old else whole_ms, local)
            del model, opt, whole
            torch.cuda.empty_cache()
    if rank == 0:
        gpu = torch.cuda.get_device_name(device)
        lines = [f"{world} ranks, {gpu}, torch {torch.__version__}, GPT-2-small shapes (12 x 768), "
                 f"batch {args.batch} x {args.block} tokens per rank, bf16 autocast; median of {args.reps}, "
                 f"best of {args.rounds} rounds", "",
                 "| optimizer | local params | step() ms | step GB/s (28 B/param) | whole step ms | step vs gradkit |",
                 "| --- | --- | --- | --- | --- | --- |"]
        ours = best["gradkit AdamW"][0]
        for name, (step_ms, whole_ms, local) in best.items():
            gbs = 28 * local / step_ms / 1e6
            lines.append(f"| {name} | {local:,} | {step_ms:.3f} | {gbs:.0f} | {whole_ms:.3f} | "
                         f"{step_ms / ours:.2f}x |")
        text = "\n".join(lines)
        print(text, flush=True)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
