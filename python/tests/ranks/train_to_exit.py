"""A distributed training script as a new user writes one: everything at
module level, nothing deleted, the last losses and their
autograd graphs still alive when Python exits (under torchrun the process
group is destroyed at the end, as torch asks). Run by test_comm.py under
mpiexec (the CPU: gradkit's MPI communicator, DDP over gloo; argv[1] a file
for gloo's rendezvous) and by test_torch_distributed.py under torchrun (a
GPU per rank, or GRADKIT_TEST_CUDA_DEVICE: gradkit's NCCL communicator from
the NCCL process group); both fail on any "leaked" line (the reports
nanobind prints at exit for gradkit objects still alive then).

1. ShardedAdamW, stage 2 where torch has its hooks (2.1 and newer), with an
   LR schedule and a step post-hook.
2. DDP with gradkit's all-reduce hook, torch's AdamW.
3. DDP with gradkit's Adasum hook, gradkit's AdamW over flat gradients
   under AmpStep."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradkit
import gradkit.torch as gt
import gradkit.torch.distributed as gtd

if "LOCAL_RANK" in os.environ:
    device = torch.device("cuda", int(os.environ.get("GRADKIT_TEST_CUDA_DEVICE", os.environ["LOCAL_RANK"])))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    comm = gtd.from_process_group()
    ddp_devices = [device.index]
else:
    device = torch.device("cpu")
    mpi = gradkit.MpiEnvironment()
    comm = gtd.Communicator(gradkit.create_mpi_communicator(gradkit.CommunicatorOptions(timeout_s=60)))
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=comm.rank, world_size=comm.size)
    ddp_devices = None
rank = comm.rank


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(device)


def batch(step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)


stage = 2 if hasattr(torch.Tensor, "register_post_accumulate_grad_hook") else 1
sharded_model = make_model()
sharded = gt.ShardedAdamW(sharded_model.parameters(), comm, lr=1e-2, stage=stage, bucket_elements=300)
sharded_sched = torch.optim.lr_scheduler.OneCycleLR(sharded, max_lr=1e-2, total_steps=10)
steps_seen = []
if hasattr(sharded, "register_step_post_hook"):
    sharded.register_step_post_hook(lambda o, args, kwargs: steps_seen.append(o.step_count))

reduced = DDP(make_model(), device_ids=ddp_devices, bucket_cap_mb=0.002)
reduced.register_comm_hook(comm, gtd.all_reduce_hook)
reduced_opt = torch.optim.AdamW(reduced.parameters(), lr=1e-2)

adasum_model = make_model()
adasum = DDP(adasum_model, device_ids=ddp_devices, bucket_cap_mb=0.002)
adasum.register_comm_hook(comm, gtd.adasum_hook)
adasum_opt = gt.AdamW(adasum_model.parameters(), lr=1e-2)
adasum_flat = gt.flat_gradients(adasum_model, adasum_opt)
amp = gt.AmpStep(adasum_opt, max_norm=1.0, init_scale=4.0)

for step in range(3):
    x, y = batch(step)
    sharded.zero_grad()
    loss = F.mse_loss(sharded_model(x), y)
    loss.backward()
    sharded.step()
    sharded_sched.step()

    reduced_opt.zero_grad()
    reduced_loss = F.mse_loss(reduced(x), y)
    reduced_loss.backward()
    reduced_opt.step()

    adasum_opt.zero_grad()
    scaled = amp.scale(F.mse_loss(adasum(x), y))
    scaled.backward()
    amp.step()

print(f"rank {rank} of {comm.size}: ok", flush=True)
if "LOCAL_RANK" in os.environ:
    dist.destroy_process_group()  # as torch asks, and as the torchrun example of docs/python.md does
