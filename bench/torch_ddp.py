#!/usr/bin/env python3
"""A data-parallel training step under torchrun: DDP's default all-reduce
against DDP with gradkit's hooks and against gradkit's arena all-reduce
without DDP, in the same run.

    torchrun --nproc-per-node 2 bench/torch_ddp.py [--reps N] [--rounds R] [--markdown FILE]

Models: the small GPT of the Python tests (python/tests/models.py) and a
model whose parameters have BERT-large's 389 shapes (334M f32 parameters;
its forward is a weighted sum of each parameter, so that the step's time is
the gradients' reduction and the optimizer, as in a large model's tail).
Cases, each with torch's fused AdamW as the optimizer:
- DDP default (NCCL all-reduce of each bucket, overlapped with backward);
- DDP + torch's own Python all-reduce hook (default_hooks.allreduce_hook):
  what calling any Python hook per bucket costs, for reference;
- DDP + gradkit.torch.distributed.all_reduce_hook;
- DDP + gradkit.torch.distributed.adasum_hook;
- no DDP: gradients in one gradkit arena (flat_gradients), one all-reduce
  after backward (all_reduce_gradients), then the step.
Per-step time: CUDA events around zero_grad + forward + backward + step,
the median of --reps steps in each of --rounds interleaved rounds (every case
once per round), the best round kept; rank 0 prints.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, "..", "python", "tests")]
import gradkit.torch as gt  # noqa: E402
import gradkit.torch.distributed as gtd  # noqa: E402
from timing import median_ms as device_ms  # noqa: E402
from torch_step import bert_large_shapes  # noqa: E402


class ShapesModel(torch.nn.Module):
    """Parameters of the given shapes; loss = sum_i w_i * sum(p_i)."""

    def __init__(self, shapes):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes)

    def forward(self, weights):
        return sum(w * p.sum() for w, p in zip(weights, self.params))


def gpt_case(device):
    import models
    torch.manual_seed(0)
    model = models.TinyGPT(layers=4, d=256, heads=8, block=128).to(device)
    batches = list(models.text_batches(device, 8, batch=32, block=128, seed=dist.get_rank()))
    state = {"i": 0}

    def loss(m):
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        return m(x, y)

    return model, loss


def bert_case(device):
    model = ShapesModel(bert_large_shapes()).to(device)
    g = torch.Generator().manual_seed(dist.get_rank())
    weights = torch.rand(len(model.params), generator=g).tolist()
    return model, lambda m: m(weights)


def steps_for(make, device, comm):
    """{case: one training step} over fresh copies of the model."""
    steps = {}
    for case in ("DDP default", "DDP + torch's Python all-reduce hook", "DDP + gradkit all-reduce hook",
                 "DDP + gradkit Adasum hook", "no DDP, gradkit arena all-reduce"):
        model, loss = make(device)
        if case.startswith("DDP"):
            wrapped = DDP(model, device_ids=[device.index])
            if "torch's Python" in case:  # what any Python hook costs DDP: torch's own, for reference
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
                wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
            elif "all-reduce hook" in case:
                wrapped.register_comm_hook(comm, gtd.all_reduce_hook)
            elif "Adasum" in case:
                wrapped.register_comm_hook(comm, gtd.adasum_hook)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step(wrapped=wrapped, opt=opt, loss=loss):
                opt.zero_grad()
                loss(wrapped).backward()
                opt.step()
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            flat = gt.flat_gradients(model)

            def step(model=model, opt=opt, loss=loss, flat=flat):
                flat.zero_()
                loss(model).backward()
                gtd.all_reduce_gradients(flat, comm)
                opt.step()
        steps[case] = step
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="gpt,bert")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    comm = gtd.from_process_group(timeout=120)
    rank0 = dist.get_rank() == 0
    rows = []
    if rank0:
        print(f"{dist.get_world_size()} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"{args.reps} reps, best of {args.rounds} interleaved rounds", flush=True)
    for key in args.models.split(","):
        name, make = {"gpt": ("small GPT", gpt_case), "bert": ("BERT-large list", bert_case)}[key]
        steps = steps_for(make, device, comm)
        best = {case: float("inf") for case in steps}
        for _ in range(args.rounds):
            for case, fn in steps.items():
                dist.barrier()
                best[case] = min(best[case], device_ms(fn, args.reps))
        numel = sum(p.numel() for p in make(device)[0].parameters()) if key == "gpt" else 334_092_288
        for case, ms in best.items():
            base = best["DDP + gradkit all-reduce hook"] if "Adasum" in case else best["DDP default"]
            versus = "vs all-reduce hook" if "Adasum" in case else "vs DDP default"
            rows.append((name, f"{numel / 1e6:.1f}M", case, f"{ms:.3f}", f"{ms / base:.3f}x {versus}"))
            if rank0:
                print(f"{name:>16} {numel / 1e6:7.1f}M  {case:<36} {ms:8.3f} ms  {ms / base:.3f}x {versus}",
                      flush=True)
        del steps
        torch.cuda.empty_cache()
    if rank0 and args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{dist.get_world_size()} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n"
                    "| model | params | case | ms per step | ratio |\n|---|---|---|---|---|\n")
            f.writelines("| " + " | ".join(r) + " |\n" for r in rows)
    del comm
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
