#!/usr/bin/env python3
"""Host time of one collective call from Python under torchrun: gradkit's
communicator (the binding and the wrapper, sum and average, 4 KiB and
25 MiB) against torch.distributed's all_reduce(async_op=True) on the same
tensors. The median over --reps calls, each after a synchronize and a
barrier, so that no call waits on a queue; rank 0 prints.

    torchrun --nproc-per-node 2 bench/torch_comm_host.py [--reps N]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import gradkit
import gradkit.torch.distributed as gtd


def host_us(fn, reps):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times), min(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    comm = gtd.from_process_group(timeout=60)
    stream = torch.cuda.current_stream().cuda_stream
    for label, numel in (("4 KiB", 1 << 10), ("25 MiB", 25 << 18)):
        x = torch.ones(numel, device=device)
        cases = {
            "DLPack conversion alone (gradkit.view_info)": lambda: gradkit.view_info(x),
            "gradkit binding, sum": lambda: comm.comm.all_reduce([x], gradkit.ReduceOp.sum, stream=stream),
            "gradkit binding, average": lambda: comm.comm.all_reduce([x], gradkit.ReduceOp.average, stream=stream),
            "gradkit.torch.distributed, average": lambda: comm.all_reduce([x], "average"),
            "torch.distributed all_reduce (async_op)": lambda: dist.all_reduce(x, async_op=True),
        }
        for name, fn in cases.items():
            median, least = host_us(fn, args.reps)
            if dist.get_rank() == 0:
                print(f"{label:>7}  {name:<45} {median:7.1f} us median, {least:6.1f} us least", flush=True)
    del comm
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
