"""How far gradkit.torch.Muon over a mesh is from the unsharded step on CUDA, and how far
each is from the float64 reference with bf16 products (python/tests/support/muon_recipe.py):
is a sharded-against-unsharded difference the products' rounding, or a step of its own?

Under torchrun with 4 ranks (GRADKIT_TEST_CUDA_DEVICE=0 and scripts/ranks-on-one-gpu put
them all on GPU 0): the matrices of ranks/muon_meshes.py's 1-D and 2 x 2 cases, torch's
step and the recipe, three steps from the same weights and gradients. Rank 0 prints, per
matrix and options, the worst step's update error (||a - b|| / ||b - w||) of sharded
against unsharded, sharded against the reference and unsharded against the reference.

    GRADKIT_TEST_CUDA_DEVICE=0 python -m torch.distributed.run --nproc-per-node 4 --no-python \
        scripts/ranks-on-one-gpu python dev/muon/mesh_rounding.py
"""
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

tests = pathlib.Path(__file__).resolve().parents[2] / "python" / "tests"
sys.path[:0] = [str(tests), str(tests / "ranks")]
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from fsdp2 import finish, full, setup  # noqa: E402
from support.muon_recipe import MuonRecipe  # noqa: E402

RECIPE = dict(ns_coefficients="polar_express", divisor="polar_express", eps=1e-6, equilibrate_rows=True,
              cautious_weight_decay=True)
REFERENCE = {"torch's": {}, "recipe": dict(triples=[tuple(t) for t in gradkit.polar_express_coefficients],
                                           divisor="polar_express", eps=1e-6, equilibrate_rows=True,
                                           cautious_weight_decay=True)}
OPTIONS = {"torch's": {}, "recipe": RECIPE}
ONE_D = [((33, 24), [Shard(0)]), ((24, 7), [Shard(1)]), ((16, 40), [Shard(1)]), ((3, 12, 10), [Shard(1)]),
         ((3, 12, 10), [Shard(2)])]
TWO_D = [((20, 14), [Shard(0), Shard(1)]), ((20, 14), [Shard(1), Shard(0)]), ((18, 10), [Shard(0), Shard(0)]),
         ((18, 10), [Replicate(), Shard(1)]), ((18, 10), [Shard(0), Replicate()]), ((4, 12, 10), [Shard(0), Shard(2)])]


def error(a, b, w):
    a, b, w = a.double().cpu(), b.double().cpu(), w.double().cpu()
    return ((a - b).norm() / (b - w).norm()).item()


def measure(device, mesh, specs, name, seed, label="", **extra):
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(shape, generator=g).to(device) / 4 for shape, _ in specs]
    sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, pl)) for w, (_, pl) in zip(whole, specs)]
    plain = [torch.nn.Parameter(w.clone()) for w in whole]
    opts = [gt.Muon(ps, lr=0.02, weight_decay=0.1, **OPTIONS[name], **extra) for ps in (sharded, plain)]
    refs = [[MuonRecipe(shape, lr=0.02, weight_decay=0.1, **REFERENCE[name]) for shape, _ in specs] for _ in range(2)]
    worst = [[0.0, 0.0, 0.0] for _ in specs]
    for _ in range(3):
        grads = [torch.randn(shape, generator=g) for shape, _ in specs]
        before = [[full(p.detach()).clone() for p in sharded], [q.detach().clone() for q in plain]]
        want = [[ref.step(w.cpu(), gr) for ref, w, gr in zip(refs[k], before[k], grads)] for k in range(2)]
        for p, q, gr, (_, pl) in zip(sharded, plain, grads, specs):
            q.grad = gr.to(device)
            p.grad = distribute_tensor(gr.to(device), mesh, pl)
        for opt in opts:
            opt.step()
        for i, (p, q) in enumerate(zip(sharded, plain)):
            s = full(p.detach())
            momentum = (full(opts[0].state[p]["momentum_buffer"]) - opts[1].state[q]["momentum_buffer"]).abs().max()
            got = (error(s, q.detach(), before[1][i]), error(s, want[0][i], before[0][i]),
                   error(q.detach(), want[1][i], before[1][i]), momentum.item())
            worst[i] = [max(a, b) for a, b in zip(worst[i] + [0.0] * (4 - len(worst[i])), got)]
    if dist.get_rank() == 0:
        for (shape, pl), (su, sr, ur, mo) in zip(specs, worst):
            print(f"{label}{name:8} {str(shape):12} {str(pl):34} sharded-unsharded {su:.4f}  sharded-reference "
                  f"{sr:.4f}  unsharded-reference {ur:.4f}  momentum apart {mo:.3g}", flush=True)


def main():
    device = setup()
    ranks = dist.get_world_size()
    for name in OPTIONS:
        measure(device, init_device_mesh(device.type, (ranks,)), ONE_D, name, seed=1)
        measure(device, init_device_mesh(device.type, (2, ranks // 2)), TWO_D, name, seed=4)
    # Where a 2-D case differs: one bucket (no side stream), each layout alone (one cohort).
    mesh = init_device_mesh(device.type, (2, ranks // 2))
    measure(device, mesh, TWO_D, "torch's", seed=4, label="1 bucket ", exchange_buckets=1)
    for spec in TWO_D:
        measure(device, mesh, [spec], "torch's", seed=4, label="alone ")
    finish(device, dist.get_rank())


if __name__ == "__main__":
    main()
