#!/usr/bin/env python3
"""The whole training step (forward, backward, optimizer step) of a GPT-2 small
shaped model (12 layers, width 768, 12 heads, vocabulary 50257, tied embedding:
124M float32 parameters; bf16 autocast; batch 8 x 512 tokens) with:

  (a) gradkit.torch.AdamW, the state on the GPU;
  (b) gradkit.torch.OffloadedAdamW (and OffloadedLamb beside gradkit's GPU Lamb), the
      state in host memory, the step on the CPU,
      buckets handed from backward's hooks (torch >= 2.1);
  (c) torchao's CPUOffloadOptimizer over torch.optim.AdamW(fused=True), when
      importable (else from a wheel in .data/wheels, unpacked into a temporary
      folder put on sys.path: the GPU machine reaches no registry);
  (d) torch.optim.AdamW(fused=True) on the GPU, for reference.

Prints ms per step (wall time of --steps steps, synchronized at the end, best
of --rounds rounds, the cases interleaved), the ratio to (a), and the GPU memory
each optimizer holds (torch.cuda.memory_allocated after a step with the
gradients freed, less before the optimizer was made: its state), with the host
memory gradkit's offloaded optimizer holds. Targets (issue 25): (b) at most
1.25x (a), and faster than (c).
The GPU time of each step is split by CUDA events into forward + backward and what follows
backward (the step; for the offloaded ones, the wait for the last copy-backs).
usage: bench/torch_offload.py [--steps N] [--rounds N] [--bucket-mb MB] [--piece-mb MB] [--host-threads N]
                              [--markdown FILE]
"""
import argparse
import glob
import os
import sys
import tempfile
import time
import zipfile

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
import gradkit.torch as gt  # noqa: E402
from models import Block  # noqa: E402  (python/tests/models.py: the small GPT's block)

VOCAB, WIDTH, LAYERS, HEADS, POSITIONS = 50257, 768, 12, 12, 1024
BATCH, TOKENS = 8, 512


class Gpt2Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(POSITIONS, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's: its gradient accumulates twice

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def torchao_offload():
    """torchao.optim.CPUOffloadOptimizer, from the environment or from .data/wheels; None if neither."""
    try:
        from torchao.optim import CPUOffloadOptimizer
        return CPUOffloadOptimizer
    except ImportError:
        pass
    wheels = sorted(glob.glob(os.path.join(HERE, "..", ".data", "wheels", "torchao-*.whl")))
    if not wheels:
        return None
    folder = tempfile.mkdtemp(prefix="torchao-")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(folder)
    sys.path.insert(0, folder)
    try:
        from torchao.optim import CPUOffloadOptimizer
        print(f"torchao from {os.path.basename(wheels[-1])} (unpacked into {folder})")
        return CPUOffloadOptimizer
    except Exception as e:  # an import error of its extensions, say
        print(f"torchao from {wheels[-1]} does not import: {type(e).__name__}: {e}")
        return None


def make_cases(bucket_mb, piece_mb, host_threads):
    cases = {
        "gradkit AdamW (GPU)": lambda p: gt.AdamW(p, lr=1e-4, weight_decay=0.1),
        "gradkit OffloadedAdamW": lambda p: gt.OffloadedAdamW(p, lr=1e-4, weight_decay=0.1, bucket_mb=bucket_mb,
                                                               piece_mb=piece_mb, host_threads=host_threads),
        # each bucket one piece: its copies and CPU step one after another
        "gradkit OffloadedAdamW, whole buckets": lambda p: gt.OffloadedAdamW(
            p, lr=1e-4, weight_decay=0.1, bucket_mb=bucket_mb, piece_mb=1024.0, host_threads=host_threads),
        # fewer host bytes per parameter for the CPU step to move: 20 and 16 against 28
        "gradkit OffloadedAdamW, bf16 moments": lambda p: gt.OffloadedAdamW(
            p, lr=1e-4, weight_decay=0.1, bucket_mb=bucket_mb, piece_mb=piece_mb, host_threads=host_threads,
            moments="bfloat16"),
        "gradkit OffloadedAdamW, int8 moments": lambda p: gt.OffloadedAdamW(
            p, lr=1e-4, weight_decay=0.1, bucket_mb=bucket_mb, piece_mb=piece_mb, host_threads=host_threads,
            moments="int8"),
    }
    # LAMB: gradkit's on the GPU and offloaded (torch has none); pieces hold whole tensors
    cases["gradkit Lamb (GPU)"] = lambda p: gt.Lamb(p, lr=1e-4, weight_decay=0.1)
    cases["gradkit OffloadedLamb"] = lambda p: gt.OffloadedLamb(p, lr=1e-4, weight_decay=0.1, bucket_mb=bucket_mb,
                                                                piece_mb=piece_mb, host_threads=host_threads)
    ao = torchao_offload()
    if ao is not None:
        cases["torchao CPUOffloadOptimizer"] = lambda p: ao(p, torch.optim.AdamW, fused=True, lr=1e-4,
                                                            weight_decay=0.1)
    cases["torch AdamW fused (GPU)"] = lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.1, fused=True)
    return cases


def batches(steps, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, TOKENS + 1), device="cuda", generator=g)
        yield x[:, :-1], x[:, 1:]


def train_step(model, opt, x, y, marks=None):
    """One step; `marks`, if given: three CUDA events recorded on the current stream before
    the forward, after the backward and after the step (which waits there for an offloaded
    step's copy-backs), so that the step's GPU time splits into forward + backward and what
    follows backward."""
    if marks:
        marks[0].record()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    if marks:
        marks[1].record()
    opt.step()
    if marks:
        marks[2].record()
    opt.zero_grad(set_to_none=True)
    return loss


class Case:
    """One optimizer over its own copy of the model (made once: the cases are interleaved)."""

    def __init__(self, make):
        torch.manual_seed(0)
        self.model = Gpt2Small().cuda()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        self.opt = make(list(self.model.parameters()))
        for x, y in batches(3, seed=1):  # warm-up: state made, hooks' counts learned, kernels chosen
            train_step(self.model, self.opt, x, y)
        torch.cuda.synchronize()
        self.state_bytes = torch.cuda.memory_allocated() - before
        self.best = float("inf")

    def run(self, steps):
        data = list(batches(steps, seed=2))
        marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in data]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for (x, y), m in zip(data, marks):
            loss = train_step(self.model, self.opt, x, y, m)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3 / steps
        if ms < self.best:
            self.best = ms
            self.forward_backward = sum(m[0].elapsed_time(m[1]) for m in marks) / steps
            self.after_backward = sum(m[1].elapsed_time(m[2]) for m in marks) / steps
            native = getattr(self.opt, "native", None)
            self.host_times = getattr(native, "last_step_times", None)
        self.loss = float(loss)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--piece-mb", type=float, default=32.0)
    parser.add_argument("--host-threads", type=int, default=0, help="the CPU step's threads (0: all cores but two)")
    parser.add_argument("--cases", help="comma-separated substrings: only the cases whose names contain one "
                        "(default: every case)")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/torch_offload.py needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs; GPT-2 small "
          f"({LAYERS} layers, width {WIDTH}), bf16 autocast, batch {BATCH} x {TOKENS}; hooks: "
          f"{hasattr(torch.Tensor, 'register_post_accumulate_grad_hook')}")
    cases = {}
    wanted = [w.strip() for w in args.cases.split(",")] if args.cases else None
    for name, make in make_cases(args.bucket_mb, args.piece_mb, args.host_threads).items():
        if wanted and not any(w in name for w in wanted):
            continue
        try:
            cases[name] = Case(make)
        except Exception as e:  # report and go on: the other cases still mean something
            print(f"{name}: cannot run: {type(e).__name__}: {e}")
    params = sum(p.numel() for p in next(iter(cases.values())).model.parameters())
    for _ in range(args.rounds):
        for c in cases.values():
            c.run(args.steps)
    base = cases.get("gradkit AdamW (GPU)")
    rows = ["| optimizer | ms / step | ratio to gradkit AdamW (GPU) | forward + backward ms | after backward ms "
            "| GPU memory of the optimizer | last loss |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in cases.items():
        ratio = f"{c.best / base.best:.3f}" if base else "-"
        rows.append(f"| {name} | {c.best:.1f} | {ratio} | {c.forward_backward:.1f} | {c.after_backward:.1f} "
                    f"| {c.state_bytes / 2**20:.1f} MiB | {c.loss:.4f} |")
    off = cases.get("gradkit OffloadedAdamW")
    notes = [f"{params / 1e6:.1f}M parameters; best of {args.rounds} rounds of {args.steps} steps."]
    for name, c in cases.items():
        if getattr(c, "host_times", None):
            t = c.host_times
            notes.append(f"{name}: host worker, last step: span {t['span_ms']:.1f} ms = waiting for gradients "
                         f"{t['copy_wait_ms']:.1f} + CPU steps {t['update_ms']:.1f} + queueing "
                         f"{t['span_ms'] - t['copy_wait_ms'] - t['update_ms']:.1f}")
    if off is not None:
        native = off.opt.native
        notes.append(f"gradkit offloaded: {native.num_buckets} buckets of about {args.bucket_mb} MiB, pieces of "
                     f"{args.piece_mb} MiB; host memory "
                     f"{native.host_bytes / 2**20:.0f} MiB; GPU bytes held by it (check scalars and scratch, no state): "
                     f"{native.device_bytes}")
        if base:
            notes.append(f"target offloaded <= 1.25x GPU: {'reached' if off.best <= 1.25 * base.best else 'NOT reached'}"
                         f" ({off.best / base.best:.3f}x)")
        ao = cases.get("torchao CPUOffloadOptimizer")
        if ao is not None:
            notes.append(f"target offloaded faster than torchao: {'reached' if off.best < ao.best else 'NOT reached'}"
                         f" ({off.best:.1f} vs {ao.best:.1f} ms)")
        else:
            notes.append("torchao: not importable, not measured")
    lamb, lamb_off = cases.get("gradkit Lamb (GPU)"), cases.get("gradkit OffloadedLamb")
    if lamb is not None and lamb_off is not None:
        notes.append(f"gradkit OffloadedLamb: {lamb_off.best / lamb.best:.3f}x gradkit Lamb on the GPU "
                     f"({lamb_off.best:.1f} vs {lamb.best:.1f} ms)")
    text = "\n".join(rows + [""] + notes)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
