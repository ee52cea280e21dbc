#!/usr/bin/env python3
"""nanochat's optimizer step on one GPU: gradkit.torch.MuonAdamW against nanochat's
own compiled MuonAdamW (nanochat/optim.py, loaded from --nanochat-optim), against
torch.optim.Muon for the matrices plus torch's fused AdamW for the rest, and
gradkit.torch.Muon with the recipe off (torch.optim.Muon's step, the same AdamW
groups) to show what the recipe costs, on nanochat's parameters for depths 12, 20
and 26 (bench/nanochat_optim.py: per layer four model_dim^2 matrices, a 4 model_dim
x model_dim and a model_dim x 4 model_dim one, ve_gates; 32768 x model_dim wte,
lm_head and value embeddings; wte and the value embeddings bfloat16, the rest
float32, as nanochat holds them), with setup_optimizer's groups.

Each case gets its own copy of the parameters, with gradients, made before it is
timed and freed after. Device time is the median over --reps of CUDA events
around one step() call after --warmup untimed ones (which make gradkit's plans and
compile nanochat's functions); ratio is the case's time over gradkit.torch.
MuonAdamW's. --smoke runs tiny shapes on the CPU (wall time) to check that the
script runs.

nanochat's optim.py is read from a file outside this repository, e.g.
git -C NANOCHAT show HEAD:nanochat/optim.py > /tmp/nanochat_optim.py
usage: bench/muon_nanochat.py --nanochat-optim PATH [--depths 12,20,26] [--reps N] [--warmup N] [--smoke]
"""
import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit.torch as gt  # noqa: E402
from nanochat_optim import load_nanochat_optim, model_dim, nanochat_param_groups, nanochat_params  # noqa: E402
from timing import median_ms  # noqa: E402


def with_grads(params, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    for ps in params.values():
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(device=p.device, dtype=p.dtype)
    return params


def gradkit_muon_adamw(params, dim, nanochat):
    return gt.MuonAdamW(nanochat_param_groups(params, dim))


def nanochat_muon_adamw(params, dim, nanochat):
    return nanochat.MuonAdamW(nanochat_param_groups(params, dim))


def adamw_groups(params, dim):
    """nanochat's AdamW groups as torch.optim.AdamW's (lr, betas, eps, weight_decay)."""
    return [{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")}
            for g in nanochat_param_groups(params, dim) if g["kind"] == "adamw"]


class TorchMuonAdamW:
    """torch.optim.Muon over the matrices (nanochat's lr, momentum, weight decay; torch's
    step) and torch's fused AdamW over the rest: what a step costs in torch itself."""

    def __init__(self, params, dim, nanochat):
        self.muon = torch.optim.Muon(params["matrix"], lr=0.02, momentum=0.95, weight_decay=0.2)
        self.adamw = torch.optim.AdamW(adamw_groups(params, dim), fused=params["matrix"][0].is_cuda)

    def step(self):
        self.muon.step()
        self.adamw.step()


def gradkit_muon_plain(params, dim, nanochat):
    """gradkit.torch.Muon with the recipe off (torch.optim.Muon's step) and the same AdamW
    groups: MuonAdamW's time over this is the recipe's cost."""
    groups = [{"params": params["matrix"], "use_muon": True}]
    groups += [{"params": g["params"], "use_muon": False, "lr": g["lr"], "betas": g["betas"], "adamw_eps": g["eps"],
                "weight_decay": g["weight_decay"]} for g in adamw_groups(params, dim)]
    return gt.Muon(groups, lr=0.02, momentum=0.95, weight_decay=0.2)


# nanochat's case last: inductor's compile workers, busy after its first call, would
# share the host with the cases after it.
CASES = [("gradkit.torch.MuonAdamW", gradkit_muon_adamw),
         ("gradkit.torch.Muon, recipe off", gradkit_muon_plain),
         ("torch Muon + fused AdamW", TorchMuonAdamW),
         ("nanochat MuonAdamW (compiled)", nanochat_muon_adamw)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanochat-optim", required=True, help="the path of nanochat's nanochat/optim.py")
    parser.add_argument("--depths", default="12,20,26")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: does the script run")
    args = parser.parse_args()

    nanochat = load_nanochat_optim(args.nanochat_optim)
    if args.smoke:
        device, cuda, depths, vocab, head_dim = "cpu", False, [2], 256, 64
        reps, warmup = 2, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no GPU visible (--smoke runs tiny shapes on the CPU)")
        device, cuda, depths, vocab, head_dim = "cuda", True, [int(d) for d in args.depths.split(",")], 32768, 128
        reps, warmup = args.reps, args.warmup
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke: tiny shapes, wall time)"
    print(f"device {name}, torch {torch.__version__}, python {sys.executable}")
    print("  ".join(f"{c:>{w}}" for c, w in zip(("depth", "model_dim", "params", "implementation", "ms", "ratio"),
                                                 (5, 9, 8, 32, 9, 6))), flush=True)
    for depth in depths:
        dim = model_dim(depth, head_dim=head_dim)
        base = None
        for case, make in CASES:
            # nanochat compiles its steps for one model's shapes (one depth a process): a new
            # depth starts dynamo afresh, as a new process would, within its recompile limit.
            torch._dynamo.reset()
            params = with_grads(nanochat_params(depth, vocab, head_dim=head_dim, device=device))
            count = sum(p.numel() for ps in params.values() for p in ps)
            opt = make(params, dim, nanochat)
            ms = median_ms(opt.step, reps, warmup=warmup, cuda=cuda)
            base = base if base is not None else ms
            row = (depth, dim, f"{count / 1e6:.0f}M", case, f"{ms:.3f}", f"{ms / base:.2f}")
            print("  ".join(f"{c:>{w}}" for c, w in zip(row, (5, 9, 8, 32, 9, 6))), flush=True)
            del opt, params
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
