#!/usr/bin/env python3
"""The Muon kernels of an Nsight Systems profile of bench/torch_muon.py --lists gpt2
(dev/gpu/profile-muon): each kernel's average time, and for the element
kernels the bytes they move per launch, GB/s and percent of copy bandwidth
measured here (torch's device-to-device copy of 1 GiB).

The element kernels run once per batch per step; the bench's header line gives
the list's parameters and batches, so a launch moves parameters / batches
elements on average (float32 parameters, gradients and momentum, bf16 X):
momentum reads g and m, writes m and X (14 B an element); the normalisation
reads and writes X (4 B); the weight update reads p and the orthogonal bf16 O
and writes p (10 B).
usage: dev/gpu/muon_kernel_table.py KERNELS_CSV BENCH_LOG
"""
import csv
import re
import sys

import torch

BYTES = {"MomentumOp": 14, "NormaliseOp": 4, "WeightOp": 10}


def copy_gbps():
    n = 1 << 28  # float32: 1 GiB
    a, b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return 2 * 4 * n / best / 1e6


def main():
    kernels_csv, bench_log = sys.argv[1:3]
    header = re.search(r"GPT-2 small: \d+ matrices, ([\d.]+)M parameters, (\d+) batches", open(bench_log).read())
    if header is None:
        sys.exit(f"{bench_log} has no GPT-2 header line; did the bench run?")
    elements, batches = float(header.group(1)) * 1e6, int(header.group(2))
    copy = copy_gbps()
    print(f"GPT-2 list: {elements / 1e6:.1f}M parameters in {batches} batches; copy {copy:.0f} GB/s")
    print(f"{'kernel':<16} {'launches':>8} {'avg us':>8} {'MB':>8} {'GB/s':>7} {'% copy':>7}")
    ops = ("MomentumOp", "NormaliseOp", "WeightOp", "AssembleOp", "DisperseOp", "mirror_kernel")
    with open(kernels_csv) as f:
        for row in csv.DictReader(f):
            label = next((op for op in ops if op in row["Name"]), None)
            if label is None:
                continue
            launches, total_ns = int(row["Instances"]), float(row["Total Time (ns)"])
            avg_us = total_ns / launches / 1e3
            per_element = BYTES.get(label)
            if per_element is None:
                print(f"{label:<16} {launches:>8} {avg_us:>8.1f}")
                continue
            # Every batch is launched as often as the others: the launches move
            # elements / batches each on average.
            mb = per_element * elements / batches / 1e6
            gbps = mb / avg_us * 1e3
            print(f"{label:<16} {launches:>8} {avg_us:>8.1f} {mb:>8.1f} {gbps:>7.0f} {100 * gbps / copy:>6.1f}%")

if __name__ == "__main__":
    main()
