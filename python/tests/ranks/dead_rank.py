"""Run by test_torch_distributed.py as 2 processes (torchrun's environment,
without torchrun, whose agent would stop the survivor): rank 1 dies after the
communicator is made; rank 0's all-reduce must end in an error within the
communicator's timeout (here 15 s) instead of hanging."""
import os
import time

import torch
import torch.distributed as dist

import gradkit.torch.distributed as gtd

TIMEOUT = 15.0

dist.init_process_group("gloo")  # the id travels over gloo: the gradkit communicator needs no NCCL group
rank = dist.get_rank()
torch.cuda.set_device(int(os.environ.get("GRADKIT_TEST_CUDA_DEVICE", rank)))
comm = gtd.from_process_group(timeout=TIMEOUT)
dist.barrier()
if rank == 1:
    os._exit(3)  # dies without a word
time.sleep(1.0)
x = torch.ones(1 << 20, device="cuda")
start = time.monotonic()
try:
    comm.all_reduce([x])
    comm.wait()
except RuntimeError as e:
    elapsed = time.monotonic() - start
    print(f"rank 0: error after {elapsed:.1f} s: {e}", flush=True)
    # os._exit: the process group's teardown would wait for the dead peer.
    os._exit(0 if elapsed <= TIMEOUT + 10 else 2)
print("rank 0: FAILED: the all-reduce with a dead peer returned", flush=True)
os._exit(1)
