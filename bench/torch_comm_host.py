#!/usr/bin/env python3
"""Host time of one collective call from Python under torchrun: gradkit's
communicator (the binding and the wrapper, sum and average, 4 KiB and
25 MiB, its calls blocking and non-blocking) against torch.distributed's all_reduce(async_op=True) on the same
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
    # scripts/ranks-on-one-gpu puts every rank on one GPU (host times hold).
    device = torch.device("cuda", int(os.environ.get("GRADKIT_TEST_CUDA_DEVICE", os.environ["LOCAL_RANK"])))
    torch.cuda.set_device(device)
    # Both ways gradkit can issue its NCCL calls (CommunicatorOptions.blocking_calls).
    comms = {calls: gtd.from_process_group(timeout=60, blocking_calls=calls == "blocking")
             for calls in ("blocking", "non-blocking")}
    stream = torch.cuda.current_stream().cuda_stream
    for label, numel in (("4 KiB", 1 << 10), ("25 MiB", 25 << 18)):
        x = torch.ones(numel, device=device)
        cases = {"DLPack conversion alone (gradkit.view_info)": lambda: gradkit.view_info(x)}
        for calls, comm in comms.items():
            cases.update({
                f"gradkit binding, sum, {calls}": lambda c=comm: c.comm.all_reduce([x], gradkit.ReduceOp.sum,
                                                                                    stream=stream),
                f"gradkit binding, average, {calls}": lambda c=comm: c.comm.all_reduce([x], gradkit.ReduceOp.average,
                                                                                        stream=stream),
                f"gradkit.torch.distributed, average, {calls}": lambda c=comm: c.all_reduce([x], "average"),
            })
        cases["torch.distributed all_reduce (async_op)"] = lambda: dist.all_reduce(x, async_op=True)
        for name, fn in cases.items():
            median, least = host_us(fn, args.reps)
            if dist.get_rank() == 0:
                print(f"{label:>7}  {name:<55} {median:7.1f} us median, {least:6.1f} us least", flush=True)
    for comm in comms.values():
        comm.wait()
    del comms
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
