"""One rank of gradkit.torch.Muon's FSDP2 tests (python/tests/test_torch_muon.py),
under torchrun: Muon over DTensor parameters sharded by rows (fully_shard), each
matrix orthogonalised whole on its owner rank. On the CPU over gloo; with CUDA
over NCCL, a GPU per rank (GRADKIT_TEST_CUDA_DEVICE: all on that one).

    fsdp2_muon.py train DIR   the test GPT and a model of odd shapes (rows that
                              do not split evenly, a 3-D expert stack with
                              fewer experts than some rank counts) trained
                              sharded and unsharded on the same data: the
                              same weights (bit for bit on the CPU; on CUDA
                              within MUON_TORCH, an owner's batch of matrices
                              being tiled otherwise than the whole batch);
                              the exchanges in one bucket and in several;
                              a skipped step (found_inf) on every rank;
                              the recipe's scales refused over shards;
                              the state saved with torch.distributed.checkpoint
                              into DIR
    fsdp2_muon.py load DIR    loads it (any rank count): the momentum equals
                              what was saved, bit for bit, and steps; then
                              the odd shapes' checks again on this rank
                              count (on 4 ranks one holds no expert)

The ranks are 2 and 4: FSDP2 averages the ranks' equal gradients, which is
exact for a power of two (on 3 ranks (g + g + g) / 3 need not be g).

Prints "rank R: ok" when every check passed."""
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import gradkit.torch as gt  # noqa: E402
from models import TinyGPT, text_batches  # noqa: E402
from tolerances import MUON_TORCH  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fsdp2 import finish, full, load_checkpoint, save_checkpoint, setup  # noqa: E402  (the FSDP2 ranks' set-up, as ranks/fsdp2.py's)


class OddShapes(torch.nn.Module):
    """Matrices whose rows split unevenly over 2, 3 or 4 ranks (7 and 33 rows) and a
    3-D stack of 3 experts (FSDP2 shards dim 0: on 4 ranks one holds none)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(24, 33)
        self.experts = torch.nn.Parameter(torch.randn(3, 33, 16) / 6)
        self.out = torch.nn.Linear(16, 7, bias=False)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = torch.einsum("bi,eij->bj", h, self.experts)
        return torch.nn.functional.mse_loss(self.out(torch.tanh(h)), y)


def odd_batches(device, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(16, 24, generator=g).to(device), torch.randn(16, 7, generator=g).to(device)


def models(kind, device, seed):
    torch.manual_seed(seed)
    make = (lambda: TinyGPT(layers=2, d=64, heads=4, block=32)) if kind == "gpt" else OddShapes
    sharded = make().to(device)
    plain = make().to(device)
    plain.load_state_dict(sharded.state_dict())
    if kind == "gpt":
        for block in sharded.blocks:
            fully_shard(block)
    fully_shard(sharded)
    return sharded, plain


def batches(kind, device, steps, seed):
    return text_batches(device, steps, batch=8, block=32, seed=seed) if kind == "gpt" else \
        odd_batches(device, steps, seed)


def train(model, opt, batch_list):
    for x, y in batch_list:
        opt.zero_grad()
        model(x, y).backward()
        opt.step()


def check_against_unsharded(kind, device, buckets=4):
    """Every rank trains on the same data, so FSDP2's averaged gradients are the
    unsharded model's, and so are Muon's updates, however many buckets the
    exchanges go in."""
    sharded, plain = models(kind, device, seed=11)
    start = [q.detach().clone() for q in plain.parameters()]
    opts = [gt.Muon(gt.muon_param_groups(m), lr=0.02, exchange_buckets=buckets) for m in (sharded, plain)]
    data = list(batches(kind, device, 6, seed=12))
    train(sharded, opts[0], data)
    train(plain, opts[1], data)
    made = [c.plan.plan.num_buckets for c in opts[0]._cohorts if hasattr(c.plan, "exchange")]
    # One sharded cohort, in several buckets when several are asked (both models have 3 or 4 shape classes).
    assert len(made) == 1 and (made[0] == 1 if buckets == 1 else 1 < made[0] <= buckets), \
        f"{kind}: buckets {made}, asked for {buckets}"
    muon_ids = {id(p) for g in opts[0].param_groups if g["use_muon"] for p in g["params"]}
    assert muon_ids, "no parameter went to Muon"
    assert all(isinstance(opts[0].state[p]["momentum_buffer"], DTensor) for p in sharded.parameters()
               if id(p) in muon_ids), "the momentum is not sharded like the parameters"
    for (name, p), q, q0 in zip(sharded.named_parameters(), plain.parameters(), start):
        got, want = full(p.detach()), q.detach()
        if device.type == "cpu" or id(p) not in muon_ids:
            assert torch.equal(got, want), f"{kind} {name}: the sharded step differs from the unsharded one"
        else:
            err = ((got - q0) - (want - q0)).norm() / (want - q0).norm()
            assert err <= MUON_TORCH, f"{kind} {name}: update differs by {err:.3g} (> {MUON_TORCH})"
    return sharded, opts[0]


def check_skip(device):
    """AmpStep's found_inf (one rank's Inf, all-reduced) skips every part of the sharded step."""
    model, _ = models("odd", device, seed=13)
    opt = gt.Muon(gt.muon_param_groups(model), lr=0.02)
    amp = gt.AmpStep(opt, enabled=False, max_norm=1.0)
    x, y = next(odd_batches(device, 1, seed=14))
    amp.scale(model(x, y)).backward()
    if dist.get_rank() == 0:
        model.experts.grad.to_local().view(-1)[0] = float("inf")
    before = [full(p.detach()).clone() for p in model.parameters()]
    amp.step()
    assert amp.found_inf, "the Inf on rank 0 was not seen"
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, full(p.detach())), "a skipped step changed a weight"
    opt.zero_grad()
    amp.scale(model(x, y)).backward()
    amp.step()
    assert not amp.found_inf
    assert any(not torch.equal(b, full(p.detach())) for b, p in zip(before, model.parameters()))


def check_refusals(device):
    """The recipe's scales of the result need whole matrices where the pieces are updated:
    refused over shards, naming the group option (and, set between steps, at the step);
    the rest of the recipe is taken."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # Columns over the ranks are taken by either kind of group (a Muon group's through
    # MuonShardedPlan's blocks; AdamW's update needs no whole matrix).
    cols = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6, device=device), mesh, [Shard(1)]))
    gt.Muon([{"params": [cols], "param_names": ["w"]}])
    gt.Muon([{"params": [cols], "use_muon": False}])
    rows = torch.nn.Parameter(distribute_tensor(torch.randn(8, 6, device=device), mesh, [Shard(0)]))
    for key, value in (("renormalize", True), ("beta2", 0.9)):
        try:
            gt.Muon([rows], **{key: value})
        except ValueError as e:
            assert f"param_groups[0][{key!r}] is {value!r}" in str(e) and "sharded DTensor" in str(e), str(e)
        else:
            raise AssertionError(f"{key}={value!r} was taken over a row-sharded DTensor")
    opt = gt.Muon([rows], ns_coefficients="polar_express", divisor="polar_express", equilibrate_rows=True,
                  cautious_weight_decay=True)
    opt.param_groups[0]["beta2"] = 0.9  # set between steps: refused at the step
    rows.grad = distribute_tensor(torch.randn(8, 6, device=device), mesh, [Shard(0)])
    try:
        opt.step()
    except ValueError as e:
        assert "param_groups[0]['beta2'] is 0.9" in str(e), str(e)
    else:
        raise AssertionError("beta2 set between steps was taken over a row-sharded DTensor")


def save(directory, device, rank):
    model, opt = check_against_unsharded("gpt", device)
    saved = save_checkpoint(model, opt, directory / "muon")
    assert any(k.endswith("momentum_buffer") for k in saved)
    if rank == 0:
        torch.save({"world": dist.get_world_size(), "state": saved}, directory / "muon_full.pt")


def load(directory, device):
    saved = torch.load(directory / "muon_full.pt")["state"]
    model, _ = models("gpt", device, seed=15)
    opt = gt.Muon(gt.muon_param_groups(model), lr=0.02)
    got = load_checkpoint(model, opt, directory / "muon")
    assert got.keys() == saved.keys(), (sorted(got)[:4], sorted(saved)[:4])
    for key, value in saved.items():
        assert torch.equal(got[key].to(value.dtype), value), f"{key} changed through the checkpoint"
    x, y = next(text_batches(device, 1, batch=8, block=32, seed=16))
    model(x, y).backward()
    opt.step()  # the loaded state steps


def main():
    what, directory = sys.argv[1], pathlib.Path(sys.argv[2])
    device = setup()
    rank = dist.get_rank()
    if what == "train":
        check_against_unsharded("odd", device)
        check_against_unsharded("odd", device, buckets=1)
        check_skip(device)
        check_refusals(device)
        save(directory, device, rank)
    else:
        load(directory, device)
        check_against_unsharded("odd", device)
        check_skip(device)
    finish(device, rank)


if __name__ == "__main__":
    main()
