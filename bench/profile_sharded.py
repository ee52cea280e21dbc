#!/usr/bin/env python3
"""Where a sharded step's device time goes: gradkit.torch.ShardedAdamW on the
BERT-large parameter list, its steps run under torch.profiler (which sees
every kernel and NCCL call in the process, gradkit's included), beside
gradkit.torch.AdamW's unsharded step. Prints, per implementation, the device
activities of one step (kernel, count, total us), busiest first, and the
step's device time from CUDA events.

One process: a one-rank NCCL communicator (no MPI, no torchrun). Under
`torchrun --nproc-per-node N`: the communicator from the process group, and
rank 0 prints. usage: bench/profile_sharded.py [--steps 5] [--bucket-mib 64]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from gradkit.torch import distributed as gtd  # noqa: E402
from timing import median_ms  # noqa: E402
from torch_step import bert_large_shapes  # noqa: E402


def communicator():
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return gtd.from_process_group()
    options = gradkit.CommunicatorOptions(timeout_s=120.0, cuda_device=torch.cuda.current_device())
    return gtd.Communicator(gradkit.create_nccl_communicator(gradkit.nccl_unique_id(), 0, 1, options))


def kernel_table(step, steps):
    """[(name, calls per step, us per step)] of the device activities of `steps` steps."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / steps, e.self_device_time_total / steps) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    comm = communicator()
    torch.manual_seed(comm.rank)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in bert_large_shapes()]
    numel = sum(p.numel() for p in params)
    sharded = gt.ShardedAdamW(params, comm, lr=1e-4, bucket_elements=(args.bucket_mib << 20) // 4)
    for v in sharded.gradients.views:
        v.normal_()
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p in plain_params:
        p.grad = torch.randn_like(p)
    plain = gt.AdamW(plain_params, lr=1e-4)
    cases = {"sharded step (ShardedAdamW)": sharded.step, "unsharded step (AdamW, no all-reduce)": plain.step}
    report = []
    for name, step in cases.items():
        ms = median_ms(step, 20)
        report.append((name, ms, kernel_table(step, args.steps)))
    if comm.rank == 0:
        print(f"{torch.cuda.get_device_name()}, {comm.size} rank(s), BERT-large list: {len(params)} tensors, "
              f"{numel / 1e6:.1f}M parameters, buckets of {args.bucket_mib} MiB; per step:")
        for name, ms, rows in report:
            print(f"\n{name}: {ms:.3f} ms (CUDA events, median of 20); device activities:")
            total = sum(r[2] for r in rows)
            print(f"  {'us':>9} {'calls':>6}  name (sum {total:.0f} us; overlapping streams can exceed the step)")
            for key, calls, us in rows[:20]:
                print(f"  {us:9.1f} {calls:6.1f}  {key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
