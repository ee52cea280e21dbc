#!/usr/bin/env python3
"""gradkit.torch.Muon over FSDP2's row-sharded DTensor parameters on N GPUs
against the same optimizer on one GPU, in the same run (issue 39's target:
the 2-GPU step at most 0.6x the one-GPU step, communication included):

    torchrun --nproc-per-node 2 bench/torch_muon_fsdp2.py [--lists gpt2,llama1b] [--reps N]
        [--buckets 1,2,4,8] [--rounds 3] [--markdown FILE]

The lists are bench/torch_muon.py's hidden matrices (GPT-2 small, 48 matrices;
Llama-shaped 1B, 112). Cases per list:
- one GPU: gradkit.torch.Muon on whole tensors (rank 0 alone, the others wait),
  and torch.optim.Muon beside it;
- N GPUs: gradkit.torch.Muon on DTensors sharded by rows (distribute_tensor,
  Shard(0): FSDP2's layout) with their sharded gradients: the whole step with
  the exchanges in each of --buckets buckets (exchange_buckets; each its own
  optimizer on the same parameters, timed in --rounds interleaved rounds, the
  best round's median kept), and the one-bucket step's parts on each rank:
  the owners' Newton-Schulz (MuonShardedPlan's orthogonalize alone: the
  balance), the two all-to-alls alone (NCCL through torch.distributed, the
  bytes the step sends), and the five parts timed with events between them
  within whole steps, one after another: what the buckets overlap.
Device time is the median over --reps of CUDA events on rank 0 (every part
runs on every rank; rank r's own figures are printed as "rank r").
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit.torch as gt  # noqa: E402
from timing import median_ms  # noqa: E402
from torch_muon import LISTS, ns_flops  # noqa: E402
from torch_step import make_params  # noqa: E402

LR = 0.02


def sharded_params(shapes, mesh, seed=0):
    """The same seeded values as make_params, as DTensors sharded by rows (the grads too)."""
    out = []
    for p in make_params(shapes, seed):
        d = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        d.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        out.append(d)
    return out


def sharded_cohort(opt):
    cohorts = [c for c in opt._cohorts if hasattr(c.plan, "exchange")]
    assert len(cohorts) == 1, "expected one sharded Muon cohort"
    return cohorts[0].plan


PARTS = ("momentum", "all-to-all", "orthogonalize", "all-to-all back", "update")


def exchanges(sharded, back):
    for k in range(sharded.plan.num_buckets):
        sharded.exchange(k, back=back)


def step_parts(sharded, reps):
    """The step's five parts one after another (every bucket's exchange between two
    parts), with CUDA events between them: each part's median time within whole
    steps (a wait for the other rank shows in the all-to-alls)."""
    stream = torch.cuda.current_stream().cuda_stream
    calls = (lambda: sharded.plan.momentum(stream=stream),
             lambda: exchanges(sharded, back=False),
             lambda: sharded.plan.orthogonalize(stream=stream),
             lambda: exchanges(sharded, back=True),
             lambda: sharded.plan.update(stream=stream))
    times = [[] for _ in calls]
    for rep in range(reps + 3):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        events[0].record()
        for call, event in zip(calls, events[1:]):
            call()
            event.record()
        events[-1].synchronize()
        if rep >= 3:
            for k in range(len(calls)):
                times[k].append(events[k].elapsed_time(events[k + 1]))
    return [sorted(t)[len(t) // 2] for t in times]


def bench_list(key, reps, rows, buckets, rounds):
    title, matrices = LISTS[key]
    shapes = matrices()
    rank, ranks = dist.get_rank(), dist.get_world_size()
    flops = ns_flops(shapes)
    params_n = sum(r * c for r, c in shapes)
    one = {}
    if rank == 0:
        params = make_params(shapes)
        opt = gt.Muon(params, lr=LR)
        one["gradkit"] = median_ms(opt.step, reps)
        del opt, params
        if hasattr(torch.optim, "Muon"):
            params = make_params(shapes)
            opt = torch.optim.Muon(params, lr=LR)
            one["torch"] = median_ms(opt.step, max(3, reps // 4))
            del opt, params
        torch.cuda.empty_cache()
    dist.barrier()
    mesh = init_device_mesh("cuda", (ranks,))
    params = sharded_params(shapes, mesh)
    opts = {b: gt.Muon(params, lr=LR, exchange_buckets=b) for b in buckets}
    for opt in opts.values():
        opt.step()  # plans
    torch.cuda.synchronize()
    step_ms = {b: float("inf") for b in buckets}
    for _ in range(rounds):  # interleaved: a slow spell of the machine falls on every count
        for b, opt in opts.items():
            step_ms[b] = min(step_ms[b], median_ms(opt.step, reps))
    made = {b: sharded_cohort(opt).plan.num_buckets for b, opt in opts.items()}
    at_once = {b: sharded_cohort(opt).plan.buckets_at_once for b, opt in opts.items()}
    sharded = sharded_cohort(opts[min(buckets)])
    ortho_ms = median_ms(lambda: sharded.plan.orthogonalize(stream=torch.cuda.current_stream().cuda_stream), reps)
    comm_ms = median_ms(lambda: (exchanges(sharded, False), exchanges(sharded, True)), reps)
    parts = step_parts(sharded, reps)
    # Bytes this rank sends to the others: its rows to their owners, its matrices' rows back.
    sent = sum(sum(c) - c[rank] for c in sharded.shard_counts + sharded.owner_counts)
    mine = torch.tensor([ortho_ms, comm_ms, sharded.plan.owned_flops, float(sent), *parts, *step_ms.values()],
                        device="cuda", dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(every, mine)
    if rank != 0:
        return
    base = one["gradkit"]

    def row(case, ms, extra=""):
        r = (title, case, f"{ms:.3f}", f"{base / ms:.2f}x" if ms else "", f"{ms / base:.2f}" if ms else "", extra)
        rows.append(r)
        print("  ".join(f"{c:>{w}}" for c, w in zip(r, (16, 44, 9, 8, 7, 30))), flush=True)

    print(f"\n{title}: {len(shapes)} matrices, {params_n / 1e6:.1f}M parameters, Newton-Schulz {flops / 1e12:.1f} TFLOP")
    row("one GPU: gradkit.torch.Muon", base, f"{flops / base / 1e9:.0f} TFLOP/s")
    if "torch" in one:
        row("one GPU: torch.optim.Muon", one["torch"])
    for b in buckets:
        row(f"{ranks} GPUs: gradkit.torch.Muon, exchange_buckets={b}", step_ms[b],
            f"{made[b]} bucket(s){', products at once' if at_once[b] and made[b] > 1 else ''}; "
            "target <= 0.60 x one GPU")
    for r, (o, c, f, sent_r, *rest) in enumerate(t.tolist() for t in every):
        within = rest[:len(PARTS)]
        row(f"  rank {r}: owners' Newton-Schulz", o, f"{5 * f / o / 1e9:.0f} TFLOP/s, {100 * 5 * f / flops:.0f}% of the FLOPs")
        row(f"  rank {r}: the all-to-alls ({made[min(buckets)]} bucket(s))", c,
            f"{sent_r / 1e9:.3f} GB sent, {sent_r / c / 1e6:.0f} GB/s")
        row(f"  rank {r}: the parts one after another", sum(within),
            " + ".join(f"{n} {ms:.3f}" for n, ms in zip(PARTS, within)))


def init_ranks():
    """torchrun's rank on the GPU of its LOCAL_RANK, in an NCCL process group bound to it."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lists", default="gpt2,llama1b")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--buckets", default="1,2,4,8", help="exchange_buckets values, each timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    init_ranks()
    rows = []
    if dist.get_rank() == 0:
        print(f"{torch.cuda.get_device_name()} x {dist.get_world_size()}, torch {torch.__version__}")
        print("  ".join(f"{c:>{w}}" for c, w in zip(("list", "case", "ms", "speedup", "x one", "notes"),
                                                     (16, 44, 9, 8, 7, 30))))
    for key in args.lists.split(","):
        bench_list(key, args.reps, rows, [int(b) for b in args.buckets.split(",")], args.rounds)
        dist.barrier()
    if args.markdown and dist.get_rank() == 0:
        with open(args.markdown, "w") as f:
            f.write("| list | case | ms | speedup over one GPU | x one GPU | notes |\n|---|---|---|---|---|---|\n")
            f.writelines("| " + " | ".join(r) + " |\n" for r in rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
