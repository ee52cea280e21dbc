#!/usr/bin/env python3
"""Where the sharded Muon step's time goes on each rank: the kernels of a few
gradkit.torch.Muon steps over FSDP2's row-sharded DTensors, seen by
torch.profiler (gradkit's kernels, cuBLAS's and NCCL's alike), laid out per
CUDA stream as a timeline of one step:

    torchrun --nproc-per-node 2 bench/timeline_muon_fsdp2.py [--lists gpt2] [--buckets 1,2]
        [--steps 5] [--trace-dir DIR]

For each list and exchange_buckets value, and each rank, it prints the step
whose span is the median of --steps steps (each step alone: the device idle
before and after it): its span (first kernel's start to last kernel's end),
how long the device was busy on any stream, and per stream the runs of
kernels (consecutive kernels with gaps under 3 us merged), with their start
and end in ms from the step's start: what overlaps and what waits. Kernels
are named by kind: gemm (cuBLAS), nccl, gradkit's multi-tensor kernels by
their Op (momentum, assemble, normalise, disperse, weight), others by their
own name. --trace-dir
keeps each rank's Chrome trace.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit.torch as gt  # noqa: E402
from torch_muon import LISTS  # noqa: E402
from torch_muon_fsdp2 import LR, init_ranks, sharded_params  # noqa: E402

GAP_US = 3.0  # kernels closer than this on one stream are one run
IDLE_S = 0.005  # the host's pause between steps: the steps' kernels never touch


def kind(name):
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_")):
        return "gemm"
    op = re.search(r"(\w+?)Op\b", name)  # gradkit's multi-tensor kernels: their Op
    if op:
        return op.group(1).split("::")[-1].lower()
    return re.sub(r"<.*", "", name).split("(")[0].split("::")[-1][:40] or name[:40]


def kernels(trace_file):
    """[(start_us, end_us, stream, name)] of the trace's device kernels, in start order."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    out = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream", -1), e["name"]) for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
           and "AllReduce" not in e["name"]]  # the barriers between steps
    return sorted(out)


def split_steps(ks, idle_us):
    """The kernels cut where the device was idle for idle_us: one list per step."""
    steps, end = [], None
    for k in ks:
        if end is None or k[0] - end > idle_us:
            steps.append([])
        steps[-1].append(k)
        end = k[1] if end is None else max(end, k[1])
    return steps


def busy_us(ks):
    """Time some kernel ran, on any stream."""
    total, at = 0.0, None
    for s, e, *_ in ks:
        if at is None or s > at:
            total += e - s
            at = e
        elif e > at:
            total += e - at
            at = e
    return total


def runs(ks, t0):
    """Per stream: [(start_ms, end_ms, kind, count)] from t0 (us), kernels of one kind
    with gaps under GAP_US merged."""
    lanes = {}
    for s, e, stream, name in ks:
        k = kind(name)
        lane = lanes.setdefault(stream, [])
        if lane and lane[-1][2] == k and s - lane[-1][1] < GAP_US:
            lane[-1] = (lane[-1][0], e, k, lane[-1][3] + 1)
        else:
            lane.append((s, e, k, 1))
    return {stream: [((s - t0) / 1e3, (e - t0) / 1e3, k, n) for s, e, k, n in lane] for stream, lane in lanes.items()}


def describe(step, rank):
    t0 = step[0][0]
    span = (max(k[1] for k in step) - t0) / 1e3
    lines = [f"  rank {rank}: span {span:.3f} ms, device busy {busy_us(step) / 1e3:.3f} ms, {len(step)} kernels"]
    for stream, lane in sorted(runs(step, t0).items(), key=lambda kv: kv[1][0][0]):
        busy = sum(e - s for s, e, *_ in lane)
        parts = ", ".join(f"{s:.3f}-{e:.3f} {k}" + (f" x{n}" if n > 1 else "") for s, e, k, n in lane)
        lines.append(f"    stream {stream} (busy {busy:.3f} ms): {parts}")
    return "\n".join(lines)


def profile_steps(opt, steps, trace_file):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dist.barrier()  # both ranks start together, as in a training step
            opt.step()
            torch.cuda.synchronize()
            time.sleep(IDLE_S)
    prof.export_chrome_trace(trace_file)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lists", default="gpt2")
    ap.add_argument("--buckets", default="1,2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trace-dir")
    args = ap.parse_args()
    init_ranks()
    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (ranks,))
    trace_dir = args.trace_dir or tempfile.mkdtemp()
    for key in args.lists.split(","):
        title, matrices = LISTS[key]
        params = sharded_params(matrices(), mesh)
        for b in (int(x) for x in args.buckets.split(",")):
            opt = gt.Muon(params, lr=LR, exchange_buckets=b)
            trace = os.path.join(trace_dir, f"muon-{key}-b{b}-rank{rank}.json")
            profile_steps(opt, args.steps, trace)
            steps = split_steps(kernels(trace), IDLE_S * 1e6 / 2)
            spans = sorted(((max(k[1] for k in s) - s[0][0]), i) for i, s in enumerate(steps))
            text = describe(steps[spans[len(spans) // 2][1]], rank)
            gathered = [None] * ranks
            dist.all_gather_object(gathered, text)
            if rank == 0:
                print(f"\n{title}, {ranks} GPUs, exchange_buckets={b} "
                      f"({len(steps)} steps seen; the median-span step of each rank)", flush=True)
                print("\n".join(gathered), flush=True)
            del opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
