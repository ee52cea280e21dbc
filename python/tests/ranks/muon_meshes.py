"""One rank of gradkit.torch.Muon's mesh tests (python/tests/test_torch_muon_meshes.py),
under torchrun: Muon over DTensor matrices sharded on tensor-parallel, 2-D and
expert-parallel meshes, each matrix orthogonalised whole on its owner rank. On the
CPU over gloo; with CUDA over NCCL, a GPU per rank (GRADKIT_TEST_CUDA_DEVICE: all on
that one).

    muon_meshes.py tp DIR       (2 ranks) a 1-D mesh: matrices and expert stacks
                                sharded along each of their dimensions (rows that
                                split unevenly), per-head groups, the recipe: the
                                same weights as unsharded Muon given the same
                                gradients; expert stacks split by experts send
                                nothing; AmpStep over the model under a TP plan
                                (below): the whole gradients' norm, and one rank's
                                Inf skips every rank
    muon_meshes.py mesh2d DIR   (4 ranks) a 2 x 2 mesh: every pairing of Shard and
                                Replicate placements, heads cut off their
                                boundaries refused; and a model under a TP plan
                                (ColwiseParallel, RowwiseParallel) with
                                fully_shard over the other mesh dimension, two
                                micro-batches a step, against unsharded Muon on
                                the accumulated gradients it ends with; its state
                                saved with torch.distributed.checkpoint into DIR;
                                AmpStep over that model as on 2 ranks
    muon_meshes.py load DIR     (2 ranks) the same model under the TP plan alone
                                (another mesh shape) loads it: the momentum equals
                                what was saved, bit for bit, and steps

On the CPU the weights are the unsharded step's bit for bit; on CUDA within
MUON_TORCH (an owner's batch of matrices is tiled otherwise than the whole batch).
Prints "rank R: ok" when every check passed."""
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import gradkit.torch as gt  # noqa: E402
from tolerances import FSDP2_NORM, MUON_TORCH  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fsdp2 import finish, full, load_checkpoint, save_checkpoint, setup  # noqa: E402

RECIPE = dict(ns_coefficients="polar_express", divisor="polar_express", eps=1e-6, equilibrate_rows=True,
              cautious_weight_decay=True)


def expect_same(device, got, want, start, what):
    """The sharded weights are the unsharded ones: bit for bit on the CPU, else within
    MUON_TORCH of the update."""
    got = full(got.detach())
    if device.type == "cpu":
        assert torch.equal(got, want), f"{what}: the sharded step differs from the unsharded one by " \
                                       f"{(got - want).abs().max().item():.3g}"
        return
    err = ((got - start) - (want - start)).norm() / (want - start).norm()
    assert err <= MUON_TORCH, f"{what}: update differs by {err:.3g} (> {MUON_TORCH})"


def against_unsharded(device, mesh, specs, group_options=None, steps=3, seed=0, **options):
    """Parameters of the given (shape, placements, heads) as DTensors on `mesh` and as
    plain tensors, the same gradients given to both (every rank draws them alike), Muon
    on each: returns the sharded optimizer once the weights were checked after every
    step."""
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(shape, generator=g).to(device) / 4 for shape, _, _ in specs]
    sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, pl)) for w, (_, pl, _) in zip(whole, specs)]
    plain = [torch.nn.Parameter(w.clone()) for w in whole]
    heads = sorted({h for _, _, h in specs}, key=lambda h: h or 0)

    def groups(params):
        return [{"params": [p for p, (_, _, ph) in zip(params, specs) if ph == h], "heads": h,
                 **(group_options or {})} for h in heads]

    opts = [gt.Muon(groups(ps), lr=0.02, weight_decay=0.1, **options) for ps in (sharded, plain)]
    for step in range(steps):
        for p, q, (shape, pl, _) in zip(sharded, plain, specs):
            grad = torch.randn(shape, generator=g).to(device)
            q.grad = grad.clone()
            p.grad = distribute_tensor(grad, mesh, pl)
        opts[0].step()
        opts[1].step()
        for i, (p, q, w) in enumerate(zip(sharded, plain, whole)):
            expect_same(device, p, q.detach(), w, f"step {step}, {specs[i][0]} placed {specs[i][1]}, "
                                                   f"heads {specs[i][2]}")
    return opts[0]


def sharded_cohorts(opt):
    return [c for c in opt._cohorts if hasattr(c.plan, "exchange")]


def check_one_dimension(device):
    """A 1-D mesh of the ranks: each dimension of matrices and stacks sharded."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    specs = [((33, 24), [Shard(0)], None),      # column-parallel (rows), uneven
             ((24, 7), [Shard(1)], None),       # row-parallel (columns), uneven
             ((16, 40), [Shard(1)], None),      # wide
             ((3, 12, 10), [Shard(1)], None),   # a stack's rows
             ((3, 12, 10), [Shard(2)], None),   # a stack's columns
             ((32, 12), [Shard(0)], 4),         # q: 4 heads of 8 rows, whole heads per rank
             ((32, 12), [Shard(1)], 4),         # heads over columns
             ((24, 12), [Replicate()], 3)]      # a replicated parameter, per head
    against_unsharded(device, mesh, specs)
    against_unsharded(device, mesh, specs, seed=1, **RECIPE)
    against_unsharded(device, mesh, specs, seed=2, exchange_buckets=1)


def check_experts(device):
    """Expert stacks split by experts (expert parallelism): each rank orthogonalises its
    own experts and sends nothing."""
    ranks = dist.get_world_size()
    mesh = init_device_mesh(device.type, (ranks,))
    specs = [((2 * ranks, 16, 24), [Shard(0)], None), ((2 * ranks, 24, 16), [Shard(0)], None)]
    opt = against_unsharded(device, mesh, specs, seed=3)
    (cohort,) = sharded_cohorts(opt)
    me, plan = dist.get_rank(), cohort.plan.plan
    for k in range(plan.num_buckets):
        sent = plan.shard_counts(k)
        assert all(n == 0 for r, n in enumerate(sent) if r != me), f"bucket {k}: experts sent {sent}"


def check_two_dimensions(device):
    """A 2 x 2 mesh: rows and columns over either dimension, nested rows, replicas."""
    mesh = init_device_mesh(device.type, (2, 2))
    specs = [((20, 14), [Shard(0), Shard(1)], None),
             ((20, 14), [Shard(1), Shard(0)], None),
             ((18, 10), [Shard(0), Shard(0)], None),
             ((18, 10), [Replicate(), Shard(1)], None),
             ((18, 10), [Shard(0), Replicate()], None),
             ((4, 12, 10), [Shard(0), Shard(2)], None),   # experts over one dimension, columns over the other
             ((24, 12), [Shard(1), Shard(0)], 2)]         # per head: each rank a whole head's columns
    against_unsharded(device, mesh, specs, seed=4)
    against_unsharded(device, mesh, specs, seed=5, **RECIPE)
    # Heads of 4 rows cut at row 6 of 12 (with the columns split too, so not whole rows).
    p = torch.nn.Parameter(distribute_tensor(torch.randn(12, 8, device=device), mesh, [Shard(0), Shard(1)]))
    p.grad = distribute_tensor(torch.randn(12, 8, device=device), mesh, [Shard(0), Shard(1)])
    opt = gt.Muon([{"params": [p], "heads": 3}])
    try:
        opt.step()
    except ValueError as e:
        assert "cut across its heads of 4 rows (heads=3)" in str(e), str(e)
    else:
        raise AssertionError("heads cut off their boundaries were taken")


class Block(torch.nn.Module):
    """A LayerNorm, then attention's projections in and out and an MLP, as a TP plan splits
    them: q and up column-parallel (rows), o and down row-parallel (columns); the norm
    stands whole on every TP rank."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = self.norm(x)
        return self.down(torch.nn.functional.gelu(self.up(x))) + self.o(self.q(x).tanh())


PLAN = {"q": ColwiseParallel(), "o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def framework_model(device, mesh, fsdp):
    torch.manual_seed(6)
    model = Block().to(device)
    plain = Block().to(device)
    plain.load_state_dict(model.state_dict())
    parallelize_module(model, mesh["tp"] if fsdp else mesh, PLAN)
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    return model, plain


def optimizer(model):
    groups = gt.muon_param_groups(model)
    q = [model.q.weight]
    groups[0]["params"] = [p for p in groups[0]["params"] if p is not model.q.weight]
    return gt.Muon(groups + [{"params": q, "heads": 4}], lr=0.02, **RECIPE)


def check_framework(device, directory):
    """A model under a TP plan and fully_shard on a 2 x 2 mesh, two micro-batches a step:
    the accumulated gradients are orthogonalised once, at the step, as unsharded Muon
    does them."""
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model, plain = framework_model(device, mesh, fsdp=True)
    placements = {tuple(p.placements) for p in model.parameters()}
    assert len(placements) > 1, placements  # _StridedShard for the column-parallel rows, Shard for the rest
    opts = [optimizer(model), optimizer(plain)]
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        start = [q.detach().clone() for q in plain.parameters()]
        for _ in range(2):
            x = torch.randn(8, 16, generator=g).to(device)
            model(x).square().mean().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            q.grad = full(p.grad).clone()
        opts[0].step()
        opts[1].step()
        for (name, p), q, q0 in zip(model.named_parameters(), plain.parameters(), start):
            expect_same(device, p, q.detach(), q0, f"step {step}, {name} placed {tuple(p.placements)}")
        opts[0].zero_grad()
        opts[1].zero_grad()
    saved = save_checkpoint(model, opts[0], directory / "meshes")
    assert any(k.endswith("momentum_buffer") for k in saved)
    if dist.get_rank() == 0:
        torch.save(saved, directory / "meshes_full.pt")


def check_amp_step(device, mesh, fsdp):
    """AmpStep over the model under the TP plan (and fully_shard): its norm is that of the
    whole gradients, each element counted once (the norm's weight stands on every TP
    rank), and an Inf in one rank's piece skips every rank's step."""
    model, _ = framework_model(device, mesh, fsdp)
    opt = optimizer(model)
    amp = gt.AmpStep(opt, max_norm=1.0, enabled=False)
    g = torch.Generator().manual_seed(3)
    model(torch.randn(8, 16, generator=g).to(device)).square().mean().backward()
    want = torch.linalg.vector_norm(torch.stack([full(p.grad).double().norm() for p in model.parameters()]))
    amp.step()
    rtol, atol = FSDP2_NORM
    torch.testing.assert_close(amp.grad_norm.double().reshape(()).cpu(), want.cpu(), rtol=rtol, atol=atol)
    assert not amp.found_inf
    opt.zero_grad()
    model(torch.randn(8, 16, generator=g).to(device)).square().mean().backward()
    if dist.get_rank() == dist.get_world_size() - 1:
        local = model.q.weight.grad.to_local()
        local.view(-1)[-1] = float("inf")
    before = [full(p.detach()).clone() for p in model.parameters()]
    amp.step()
    assert amp.found_inf, "a rank whose pieces were finite did not see another rank's Inf"
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, full(p.detach())), "a skipped step changed a weight"


def load(directory, device):
    """The 2 x 2 run's state into the model under the TP plan alone on 2 ranks."""
    saved = torch.load(directory / "meshes_full.pt")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model, _ = framework_model(device, mesh, fsdp=False)
    opt = optimizer(model)
    got = load_checkpoint(model, opt, directory / "meshes")
    assert got.keys() == saved.keys(), (sorted(got)[:4], sorted(saved)[:4])
    for key, value in saved.items():
        assert torch.equal(got[key].to(value.dtype), value), f"{key} changed through the checkpoint"
    model(torch.randn(8, 16, device=device)).square().mean().backward()
    opt.step()  # the loaded state steps


def main():
    what, directory = sys.argv[1], pathlib.Path(sys.argv[2])
    device = setup()
    if what == "tp":
        check_one_dimension(device)
        check_experts(device)
        check_amp_step(device, init_device_mesh(device.type, (dist.get_world_size(),)), fsdp=False)
    elif what == "mesh2d":
        check_two_dimensions(device)
        check_experts(device)
        check_framework(device, directory)
        check_amp_step(device, init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp")), fsdp=True)
    else:
        load(directory, device)
    finish(device, dist.get_rank())


if __name__ == "__main__":
    main()
