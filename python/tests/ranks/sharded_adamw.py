"""gradkit.torch.ShardedAdamW against DDP's default all-reduce with
torch.optim.AdamW and the same lr schedule; every rank ends with the same
weights; its state saved and loaded goes on bitwise alike; bfloat16 models
with float32 or remainder masters (the same state file); stage 2 (torch
2.1 and newer) equals stage 1 and, dropped, is freed with its hooks; bad
input is refused. Exits non-zero on the
first mismatch. Two ways to run it:
- by test_comm.py under mpiexec (2 or 3 ranks, the CPU): gradkit's MPI
  communicator, DDP over gloo; argv[1] names a file for gloo's rendezvous;
- by test_torch_distributed.py under torchrun (2 GPUs): gradkit's NCCL
  communicator from the NCCL process group; argv[1] a path prefix for the
  state file."""
import copy
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradkit
import gradkit.torch as gt
import gradkit.torch.distributed as gtd
from gradkit.torch._device import stream_handle
from torch_ddp_cpu import batch, close, fail
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tolerances import SHARDED_INT4, SHARDED_INT4_MOVED  # noqa: E402

TORCHRUN = "LOCAL_RANK" in os.environ
DEVICE = (torch.device("cuda", int(os.environ.get("GRADKIT_TEST_CUDA_DEVICE", os.environ["LOCAL_RANK"]))) if TORCHRUN
          else torch.device("cpu"))

STEPS = 20
BUCKET = 300  # elements: several buckets even for this model


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(DEVICE)


def loss_of(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE))


def schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)


def train_reference(make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2)):
    model = make_model()
    ddp = DDP(model, device_ids=[DEVICE.index] if TORCHRUN else None)
    opt = make_optimizer(model.parameters())
    sched = schedule(opt)
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(ddp, step, dist.get_rank()).backward()
        opt.step()
        sched.step()
    del ddp
    return [p.detach().clone() for p in model.parameters()]


def train_sharded(comm, stage=1, steps=STEPS, model=None, opt=None, first=0, **options):
    if model is None:
        model = make_model()
        opt = gt.ShardedAdamW(model.parameters(), comm, lr=1e-2, stage=stage, bucket_elements=BUCKET, **options)
    sched = schedule(opt) if first == 0 else None
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, step, comm.rank).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return model, opt


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def same_on_every_rank(rank, size, tensors, what):
    for t in tensors:
        t = t.float()  # exact for every parameter dtype; gloo gathers no bfloat16
        everyone = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(everyone, t)
        if not all(torch.equal(everyone[0], x) for x in everyone):
            fail(rank, f"{what}: the ranks hold different weights")


def main():
    if TORCHRUN:
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl")
        run(gtd.from_process_group())
        return
    with gradkit.MpiEnvironment():
        comm = gtd.Communicator(gradkit.create_mpi_communicator(gradkit.CommunicatorOptions(timeout_s=60)))
        dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=comm.rank, world_size=comm.size)
        run(comm)
        del comm  # before MPI is finalized


def run(comm):
    rank, size = comm.rank, comm.size

    reference = train_reference()
    model, opt = train_sharded(comm)
    close(rank, weights(model), reference, "ShardedAdamW against DDP + torch.optim.AdamW")
    same_on_every_rank(rank, size, weights(model), "stage 1")
    n = sum(p.numel() for p in model.parameters())
    if not 0 < opt.state_bytes <= 8 * n / size + 3 * 256 * 2 * len(list(model.parameters())):
        fail(rank, f"holds {opt.state_bytes} bytes of state, expected about 8 x {n} / {size}")
    if opt.step_count != STEPS:
        fail(rank, f"step_count {opt.step_count}, expected {STEPS}")

    # 8-bit moments: shards on 256-element block boundaries, about 2 bytes of state per
    # parameter, every rank alike, and weights near the float32 moments' (20 steps of lr 1e-2).
    eight, eight_opt = train_sharded(comm, moments="int8")
    same_on_every_rank(rank, size, weights(eight), "8-bit moments")
    if eight_opt.layout.alignment != gradkit.QUANT_BLOCK:
        fail(rank, f"8-bit moments on a layout aligned to {eight_opt.layout.alignment}, expected {gradkit.QUANT_BLOCK}")
    held = torch.tensor([eight_opt.state_bytes, opt.state_bytes], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(held)  # a rank may hold no block of so small a model: the ranks' totals
    if not 0 < held[0] < held[1] / 2:
        fail(rank, f"8-bit moments hold {held[0]:.0f} bytes over the ranks, float32 ones {held[1]:.0f}")
    if not all(torch.allclose(a, b, rtol=0, atol=0.05) for a, b in zip(weights(eight), weights(model))):
        fail(rank, "8-bit moments moved the weights far from the float32 moments' run")

    # 4-bit moments, the same way: about 1 byte of state per parameter, and the weights
    # those of gradkit.torch.AdamW with int4 moments stepping the whole model on one rank
    # (every rank's shard holds whole 128-element blocks, so the codes are the same).
    four, four_opt = train_sharded(comm, moments="int4")
    same_on_every_rank(rank, size, weights(four), "4-bit moments")
    held = torch.tensor([four_opt.state_bytes, eight_opt.state_bytes], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(held)
    if not 0 < held[0] < held[1]:
        fail(rank, f"4-bit moments hold {held[0]:.0f} bytes over the ranks, 8-bit ones {held[1]:.0f}")
    alone = train_reference(lambda params: gt.AdamW(params, lr=1e-2, moments="int4", min_4bit_size=0))
    worst = max((a - b).abs().max().item() for a, b in zip(weights(four), alone))
    moved = sum(int(((a - b).abs() > 1e-6).sum()) for a, b in zip(weights(four), alone)) / sum(a.numel() for a in alone)
    if worst > SHARDED_INT4 or moved > SHARDED_INT4_MOVED:
        fail(rank, f"4-bit moments: the sharded weights are {worst:.3g} from gradkit.torch.AdamW(moments='int4')'s "
                   f"under DDP ({100 * moved:.1f}% of them by more than 1e-6), more than {SHARDED_INT4} "
                   f"({100 * SHARDED_INT4_MOVED:.0f}%)")

    if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        staged, staged_opt = train_sharded(comm, stage=2)
        if not all(torch.equal(a, b) for a, b in zip(weights(staged), weights(model))):
            fail(rank, "stage 2 differs from stage 1")
        # Its hooks on the parameters do not keep it alive (they live in torch's C++, where the
        # garbage collector does not look), and they go with it.
        gone = weakref.ref(staged_opt)
        del staged_opt
        gc.collect()
        if gone() is not None or any(p._post_accumulate_grad_hooks for p in staged.parameters()):
            fail(rank, "a stage-2 ShardedAdamW dropped is still alive, or its hooks are left on the parameters")

    # Saved after 10 steps and loaded into a new optimizer (the weights go with the
    # model): both go on alike, bit for bit.
    path = sys.argv[1] + ".state"
    first, first_opt = train_sharded(comm, steps=10)
    first_opt.save(path)
    second = make_model()
    with torch.no_grad():
        for a, b in zip(second.parameters(), first.parameters()):
            a.copy_(b)
    second_opt = gt.ShardedAdamW(second.parameters(), comm, lr=1e-2, bucket_elements=BUCKET)
    second_opt.load(path)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # gradkit keeps learning rates in float32
    if second_opt.step_count != 10 or f32(second_opt.param_groups[0]["lr"]) != f32(first_opt.param_groups[0]["lr"]):
        fail(rank, f"loaded step {second_opt.step_count}, lr {second_opt.param_groups[0]['lr']}")
    train_sharded(comm, steps=5, model=first, opt=first_opt, first=10)
    train_sharded(comm, steps=5, model=second, opt=second_opt, first=10)
    if not all(torch.equal(a, b) for a, b in zip(weights(first), weights(second))):
        fail(rank, "the run loaded from the file differs from the run that saved it")
    dist.barrier()
    if rank == 0:
        os.remove(path)

    # bfloat16 parameters: float32 masters kept for the shard, against gradkit's
    # unsharded AdamW (float32 masters too) after gradkit's all-reduce (average).
    # The sums may add in another order: the weights agree to bfloat16 rounding.
    low, ref = make_model().to(torch.bfloat16), make_model().to(torch.bfloat16)
    low_opt = gt.ShardedAdamW(low.parameters(), comm, lr=1e-2, bucket_elements=BUCKET)
    ref_opt = gt.AdamW(ref.parameters(), lr=1e-2)
    for step in range(10):
        for m, o in ((low, low_opt), (ref, ref_opt)):
            o.zero_grad()
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(m(x.to(DEVICE, torch.bfloat16)).float(), y.to(DEVICE)).backward()
        gtd.all_reduce_gradients(ref, comm)
        low_opt.step()
        ref_opt.step()
    for i, (a, b) in enumerate(zip(low.parameters(), ref.parameters())):
        if not torch.allclose(a.float(), b.float(), rtol=2 ** -6, atol=1e-3):
            fail(rank, f"bfloat16 ShardedAdamW: parameter {i} differs by {float((a.float() - b.float()).abs().max()):g}")
    same_on_every_rank(rank, size, weights(low), "bfloat16")

    # master="remainder": the same bfloat16 model keeping an int16 remainder per
    # parameter of the shard instead of a float32 master, fed the float32-master
    # run's gradients: its state file (float32 masters, joined) is that run's byte
    # for byte, and it holds 2 bytes a parameter less.
    rem, f32m = make_model().to(torch.bfloat16), make_model().to(torch.bfloat16)
    rem_opt = gt.ShardedAdamW(rem.parameters(), comm, lr=1e-2, bucket_elements=BUCKET, master="remainder")
    f32m_opt = gt.ShardedAdamW(f32m.parameters(), comm, lr=1e-2, bucket_elements=BUCKET)
    for step in range(10):
        for m, o in ((rem, rem_opt), (f32m, f32m_opt)):
            o.zero_grad()
            x, y = batch(step, rank)
            torch.nn.functional.mse_loss(m(x.to(DEVICE, torch.bfloat16)).float(), y.to(DEVICE)).backward()
        with torch.no_grad():
            for a, b in zip(rem.parameters(), f32m.parameters()):
                a.grad.copy_(b.grad)  # the same gradients (the weights differ on ties: rounded away from zero)
        rem_opt.step()
        f32m_opt.step()
    same_on_every_rank(rank, size, weights(rem), "remainder masters")
    paths = [sys.argv[1] + f".{form}.state" for form in ("remainder", "float32")]
    rem_opt.save(paths[0])
    f32m_opt.save(paths[1])
    dist.barrier()
    if rank == 0:
        files = [open(p, "rb").read() for p in paths]
        if files[0] != files[1]:
            fail(rank, f"remainder masters: the state file differs from the float32 masters' ({len(files[0])} vs "
                       f"{len(files[1])} bytes)")
    parameters = sum(p.numel() for p in rem.parameters())
    held = torch.tensor([float(rem_opt._sharded.state_bytes), float(f32m_opt._sharded.state_bytes)], device=DEVICE)
    dist.all_reduce(held)
    # 2 bytes a parameter, less what the pieces' 256-byte alignment keeps on a model this small
    if not held[1] - held[0] >= 1.5 * parameters:
        fail(rank, f"remainder masters hold {held[0]:.0f} bytes over the ranks, float32 masters {held[1]:.0f}")
    rem_opt.load(paths[1])  # the float32-master run's file, split into weights and remainders
    for i, (a, b) in enumerate(zip(rem.parameters(), f32m.parameters())):
        if not torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=0):
            fail(rank, f"remainder masters: parameter {i} after the load is not the loaded master's rounding")
    dist.barrier()
    if rank == 0:
        for p in paths:
            os.remove(p)

    # gradkit.ShardedLamb through the bindings: the same gradients on every rank,
    # so the average is exact; against gradkit.Lamb unsharded on the same values.
    sizes = [300, 7, 1000]
    layout = gradkit.ShardedLayout(sizes, size, bucket_elements=500)
    where = "cpu" if DEVICE.type == "cpu" else f"cuda:{DEVICE.index}"
    w_arena = gradkit.GradientArena(where, gradkit.DType.f32, layout)
    g_arena = gradkit.GradientArena(where, gradkit.DType.f32, layout)
    w_views = [torch.from_dlpack(a) for a in w_arena.gradients()]
    g_views = [torch.from_dlpack(a) for a in g_arena.gradients()]
    gen = torch.Generator().manual_seed(5)
    w_ref = [torch.randn(n, generator=gen).to(DEVICE) for n in sizes]
    g_ref = [torch.randn(n, generator=gen).to(DEVICE) for n in sizes]
    hyper = gradkit.LambHyperparameters(lambda_=0.01)
    lamb = gradkit.ShardedLamb(comm.comm, layout, [{"params": w_views, "grads": g_views, "hyperparameters": hyper}],
                               eta=1e-2)
    plain = gradkit.Lamb([{"params": w_ref, "grads": g_ref, "hyperparameters": hyper}], eta=1e-2)
    for a, b in zip(w_views, w_ref):
        a.copy_(b)
    for _ in range(3):
        for a, b in zip(g_views, g_ref):
            a.copy_(b)  # the same on every rank: the reduce-scatter's average is exact
        lamb.step(stream_handle(DEVICE))
        plain.step(stream_handle(DEVICE))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    close(rank, [w.clone() for w in w_views], w_ref, "ShardedLamb against Lamb")
    if lamb.step_count != 3 or abs(lamb.eta - 1e-2) > 1e-9:
        fail(rank, f"ShardedLamb step_count {lamb.step_count}, eta {lamb.eta}")
    del lamb

    # Bad input: named, and nothing made.
    for call, expected in [(lambda: gt.ShardedAdamW(make_model().parameters(), comm, stage=3), "stage is 3"),
                           (lambda: gt.ShardedAdamW(make_model().parameters(), comm, master="half"), "master is 'half'"),
                           (lambda: gt.ShardedAdamW(make_model().parameters(), comm, master="remainder"),
                            "master='remainder' with parameters of dtypes ['torch.float32']"),
                           (lambda: opt.state_dict(), "save(path)"), (lambda: copy.deepcopy(opt), "save(path)")]:
        try:
            call()
            fail(rank, f"accepted: expected an error saying {expected!r}")
        except (ValueError, NotImplementedError, TypeError) as e:
            if expected not in str(e):
                fail(rank, f"the error does not say {expected!r}: {e}")
    try:
        opt.load(sys.argv[1] + ".missing")
        fail(rank, "loaded a missing file")
    except OSError as e:
        if ".missing" not in str(e):
            fail(rank, f"the error does not name the file: {e}")

    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} of {size}: ok", flush=True)


if __name__ == "__main__":
    main()
