"""Run by test_comm.py under mpiexec (2 or 3 ranks, the CPU): gradkit.torch.
distributed's DDP hooks and all_reduce_gradients over gradkit's MPI
communicator, against DDP's default all-reduce over a gloo process group
(torch.distributed beside gradkit, as in a real job). argv[1]: a file for
the gloo rendezvous. Exits non-zero on the first mismatch."""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradkit
import gradkit.torch as gt
import gradkit.torch.distributed as gtd

STEPS = 20
TOL = dict(rtol=1e-5, atol=1e-6)  # reduction order only


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


def train_ddp(comm, hook, rank):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets even for this model
    if hook is not None:
        ddp.register_comm_hook(comm, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(ddp, step, rank).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_flat(comm, rank):
    model = make_model()
    opt = gt.AdamW(model.parameters(), lr=1e-2)
    flat = gt.flat_gradients(model, opt)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        gtd.all_reduce_gradients(flat, comm)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def fail(rank, message):
    print(f"rank {rank}: FAILED: {message}", flush=True)
    sys.exit(1)


def close(rank, a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.allclose(x, y, **TOL):
            fail(rank, f"{what}: parameter {i} differs by {float((x - y).abs().max()):g}")


def main():
    with gradkit.MpiEnvironment():
        comm = gtd.Communicator(gradkit.create_mpi_communicator(gradkit.CommunicatorOptions(timeout_s=60)))
        rank, size = comm.rank, comm.size
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=size)

        # A bad reduction is refused, naming the argument, before anything is sent or written.
        x = torch.full((5,), float(rank + 1))
        try:
            comm.all_reduce([x], "max")
            fail(rank, "op='max' was accepted")
        except ValueError as e:
            if "op is 'max'" not in str(e) or not torch.equal(x, torch.full((5,), float(rank + 1))):
                fail(rank, f"the error does not name op, or the tensor was written: {e}")

        default = train_ddp(comm, None, rank)
        close(rank, train_ddp(comm, gtd.all_reduce_hook, rank), default, "all-reduce hook against DDP's default")
        close(rank, train_flat(comm, rank), default, "all_reduce_gradients over flat gradients against DDP")

        # The Adasum hook: the gradients DDP ends with are gradkit's Adasum of the ranks' own.
        reference = make_model()
        loss_of(reference, 0, rank).backward()
        grads = [p.grad for p in reference.parameters()]
        comm.adasum(grads)
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.002)
        ddp.register_comm_hook(comm, gtd.adasum_hook)
        loss_of(ddp, 0, rank).backward()
        close(rank, [p.grad for p in model.parameters()], grads, "Adasum hook against gradkit's Adasum")
        for p in model.parameters():
            everyone = [torch.empty_like(p.grad) for _ in range(size)]
            dist.all_gather(everyone, p.grad)
            if not all(torch.equal(everyone[0], g) for g in everyone):
                fail(rank, "the Adasum hook left the ranks with different gradients")

        del ddp  # before its process group: a DDP outliving it waits on gloo when freed
        dist.barrier()
        dist.destroy_process_group()
        del comm
    print(f"rank {rank} of {size}: ok", flush=True)


if __name__ == "__main__":
    main()
