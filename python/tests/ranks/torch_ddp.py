"""Run by test_torch_distributed.py under torchrun (2 or more GPUs, one per
rank): gradkit.torch.distributed against torch's DDP.

1. DDP with gradkit's all-reduce hook against DDP's default over 100 AdamW
   steps of a small model (f32): the same weights within reduction-order
   rounding; and the loop without DDP (flat gradients, one arena all-reduce).
2. DDP with gradkit's Adasum hook: the gradients equal gradkit's Adasum of
   the same per-rank gradients (computed without DDP), and every rank ends
   with bitwise identical weights.
Exits non-zero on the first failure."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradkit.torch as gt
import gradkit.torch.distributed as gtd

STEPS = 100
TOL = dict(rtol=1e-4, atol=1e-6)  # 100 steps apart by reduction order only (measured: ~1e-6 relative)


def fail(msg):
    print(f"rank {dist.get_rank()}: FAILED: {msg}", flush=True)
    sys.exit(1)


def make_model(device):
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 10)).to(device)


def batch(step, rank, device):
    g = torch.Generator().manual_seed(10_000 * rank + step)  # each rank its own data
    return torch.randn(32, 64, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device)


def train_ddp(device, comm, hook):
    model = make_model(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=1)  # several buckets
    if hook is not None:
        ddp.register_comm_hook(comm, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank(), device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_flat(device, comm):
    model = make_model(device)
    opt = gt.AdamW(model.parameters(), lr=1e-3)
    flat = gt.flat_gradients(model, opt)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank(), device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        gtd.all_reduce_gradients(flat, comm)
        opt.step()
    comm.wait()
    return [p.detach().clone() for p in model.parameters()]


def same_on_every_rank(tensors, what):
    for t in tensors:
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
        if not all(torch.equal(gathered[0], g) for g in gathered):
            fail(f"{what}: the ranks' weights differ")


def close(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.allclose(x, y, **TOL):
            fail(f"{what}: parameter {i} differs by {float((x - y).abs().max()):g}")


def check_adasum_hook(device, comm):
    model = make_model(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=1)
    ddp.register_comm_hook(comm, gtd.adasum_hook)
    reference = make_model(device)
    x, y = batch(0, dist.get_rank(), device)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    grads = [p.grad for p in reference.parameters()]
    comm.adasum(grads)  # gradkit's Adasum of the same per-rank gradients, as one list
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    torch.cuda.synchronize()
    # Halvings cut the list where its layout puts them, so the f64 sums may differ in their last bits.
    close([p.grad for p in model.parameters()], grads, "Adasum hook against gradkit's Adasum")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(20):
        opt.step()
        opt.zero_grad()
        x, y = batch(step + 1, dist.get_rank(), device)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    same_on_every_rank([p.detach() for p in model.parameters()], "Adasum hook")


def main():
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("GRADKIT_TEST_CUDA_DEVICE", os.environ["LOCAL_RANK"])))
    torch.cuda.set_device(device)
    comm = gtd.from_process_group(timeout=60)
    if (comm.rank, comm.size) != (dist.get_rank(), dist.get_world_size()):
        fail(f"rank/size {comm.rank}/{comm.size}, expected {dist.get_rank()}/{dist.get_world_size()}")

    default = train_ddp(device, comm, None)
    hooked = train_ddp(device, comm, gtd.all_reduce_hook)
    close(hooked, default, "DDP with gradkit's all-reduce hook against DDP's default")
    same_on_every_rank(hooked, "all-reduce hook")
    flat = train_flat(device, comm)
    close(flat, default, "flat gradients with all_reduce_gradients against DDP's default")
    check_adasum_hook(device, comm)

    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: ok", flush=True)
    del comm
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
