#!/usr/bin/env python3
"""The Muon step on one GPU: gradkit.torch.Muon against torch.optim.Muon in the
same run, on the hidden matrices of the test GPT (python/tests/models.TinyGPT,
8 matrices), GPT-2 small (48 matrices, 84.9M parameters) and a Llama-shaped
1B model (d 2048, 16 layers, 112 matrices).

Cases per list:
- torch.optim.Muon.step() and gradkit.torch.Muon.step() (each .grad read);
- gradkit's MuonPlan.step() alone (the C++ step, no Python layer), with
  ns_steps 5 and 1: their difference / 4 is one Newton-Schulz iteration, so
  5 x that is gradkit's Newton-Schulz alone, without the element passes;
  and the same with whole symmetric products (split_from past every matrix),
  with the batches one after another on one stream (streams=1), and
  without the recorded CUDA graph (graphs=False);
- torch's bare Newton-Schulz in bf16, batched by shape (torch.baddbmm, the
  issue's anchor), and torch's fused AdamW step on the same matrices.

FLOPs are Newton-Schulz's: 5 x (4 m^2 k + 2 m^3) per m x k matrix (m <= k),
whatever a case does besides; TFLOP/s is that over the case's time, and
"% peak" compares it with a bf16 matmul measured in the same run (8192^3,
torch.matmul) and with the H100's dense bf16 specification (989 TFLOP/s).
Device time is the median over --reps of CUDA events around the call (best
of --rounds interleaved rounds); host us is the call's wall time.
With --training, also one whole training step (forward, backward, clip,
step) of the test GPT and of a GPT-2-small-shaped model, AdamW against Muon
(each on its own copy of the model, the cases taking turns for at least 5
rounds, each keeping its best round: a small model's step is bound by the
host; host us: the optimizers' step() calls' own wall time in that loop).
usage: bench/torch_muon.py [--reps N] [--rounds N] [--lists testgpt,gpt2,llama1b] [--training] [--markdown FILE]
"""
import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from timing import median_ms  # noqa: E402
from torch_step import make_params  # noqa: E402  (seeded parameters with gradients, on the GPU)

SPEC_PEAK_TFLOPS = 989.0  # H100 SXM dense bf16
NS = (3.4445, -4.775, 2.0315)


def gpt2_matrices():
    d = 768
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 12


def llama1b_matrices():
    d, ffn = 2048, 8192
    return [(d, d)] * 4 * 16 + [(ffn, d), (ffn, d), (d, ffn)] * 16


def test_gpt_matrices():
    d = 128  # python/tests/models.TinyGPT: 2 layers
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 2


LISTS = {"gpt2": ("GPT-2 small", gpt2_matrices), "llama1b": ("Llama-shaped 1B", llama1b_matrices),
         "testgpt": ("test GPT", test_gpt_matrices)}


def ns_flops(shapes, steps=5):
    total = 0
    for r, c in shapes:
        m, k = min(r, c), max(r, c)
        total += steps * (4 * m * m * k + 2 * m ** 3)
    return total


def host_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    us = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return us


def matmul_tflops(reps):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = median_ms(lambda: a @ b, reps)
    return 2 * 8192 ** 3 / ms / 1e9


def bare_newton_schulz(params):
    """torch's Newton-Schulz alone, bf16, one baddbmm chain per shape (the issue's anchor)."""
    by_shape = {}
    for p in params:
        by_shape.setdefault(tuple(p.shape), []).append(p.grad)
    stacks = []
    for (r, c), grads in by_shape.items():
        x = torch.stack(grads).bfloat16()
        stacks.append(x.transpose(1, 2).contiguous() if r > c else x)
    a, b, c = NS

    def run():
        for x in stacks:
            x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=1e-7)
            for _ in range(5):
                gram = torch.bmm(x, x.transpose(1, 2))
                poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
                x = torch.baddbmm(x, poly, x, beta=a)
    return run


WHOLE = 1 << 40  # split_from: no matrix is split


def muon_plan(params, ns_steps, split_from=None, streams=None, graphs=None):
    momentum = [torch.zeros_like(p) for p in params]
    extra = {} if split_from is None else {"split_from": split_from}
    if streams is not None:
        extra["streams"] = streams
    if graphs is not None:
        extra["graphs"] = graphs
    plan = gradkit.MuonPlan([p.detach() for p in params], [p.grad for p in params], momentum,
                            [(1, *p.shape) for p in params],
                            [gradkit.MuonHyperparameters(lr=0.02, ns_steps=ns_steps)], **extra)
    stream = torch.cuda.current_stream().cuda_stream
    return lambda: plan.step(stream=stream), plan, momentum


def bench_list(key, reps, rounds, peak, rows):
    name, shapes_fn = LISTS[key]
    shapes = shapes_fn()
    flops = ns_flops(shapes)
    params = make_params(shapes)
    numel = sum(p.numel() for p in params)
    ours = gt.Muon(params, lr=0.02)
    theirs = torch.optim.Muon(params, lr=0.02)  # both update the same weights: timing only
    adamw = torch.optim.AdamW(params, lr=1e-3, fused=True)
    plan5, plan5_obj, _ = muon_plan(params, 5)
    plan1, _, _ = muon_plan(params, 1)
    whole5, _, _ = muon_plan(params, 5, WHOLE)
    whole1, _, _ = muon_plan(params, 1, WHOLE)
    serial, _, _ = muon_plan(params, 5, streams=1)
    eager, _, _ = muon_plan(params, 5, graphs=False)
    cases = {"torch.optim.Muon": theirs.step, "gradkit.torch.Muon": ours.step, "gradkit MuonPlan": plan5,
             "gradkit MuonPlan ns_steps=1": plan1, "gradkit MuonPlan, whole products": whole5,
             "gradkit MuonPlan, whole, ns_steps=1": whole1, "gradkit MuonPlan, one stream": serial,
             "gradkit MuonPlan, no graph": eager,
             "torch bare NS (baddbmm)": bare_newton_schulz(params),
             "torch fused AdamW": adamw.step}
    best = {n: math.inf for n in cases}
    for _ in range(rounds):
        for n, fn in cases.items():
            best[n] = min(best[n], median_ms(fn, reps))
    hosts = {n: host_us(cases[n]) for n in ("torch.optim.Muon", "gradkit.torch.Muon", "gradkit MuonPlan",
                                            "gradkit MuonPlan, one stream", "gradkit MuonPlan, no graph")}
    derived = {"gradkit Newton-Schulz alone (derived)":
               5 * (best["gradkit MuonPlan"] - best["gradkit MuonPlan ns_steps=1"]) / 4,
               "gradkit NS alone, whole products (derived)":
               5 * (best["gradkit MuonPlan, whole products"] - best["gradkit MuonPlan, whole, ns_steps=1"]) / 4}
    print(f"\n{name}: {len(shapes)} matrices, {numel / 1e6:.1f}M parameters, {plan5_obj.num_batches} batches, "
          f"Newton-Schulz {flops / 1e12:.2f} TFLOP; bf16 matmul measured {peak:.0f} TFLOP/s; MuonPlan workspace "
          f"{plan5_obj.workspace_bytes / 2 ** 20:.0f} MiB", flush=True)
    torch_ms = best["torch.optim.Muon"]
    for n, ms in list(best.items()) + list(derived.items()):
        counted = flops if "AdamW" not in n and "ns_steps=1" not in n else None
        tflops = counted / ms / 1e9 if counted else None
        row = (name, n, f"{ms:.2f}", f"{hosts[n]:.0f}" if n in hosts else "",
               f"{tflops:.0f}" if tflops else "", f"{100 * tflops / peak:.1f}%" if tflops else "",
               f"{100 * tflops / SPEC_PEAK_TFLOPS:.1f}%" if tflops else "", f"{torch_ms / ms:.2f}x")
        rows.append(row)
        print("  ".join(f"{c:>{w}}" for c, w in zip(row, (16, 44, 8, 8, 7, 8, 8, 7))), flush=True)
    del ours, theirs, adamw, params
    torch.cuda.empty_cache()


def bench_training(reps, rounds, rows):
    """One whole training step (forward, backward, clip, step) of the test GPT
    (python/tests/models.TinyGPT: 2 layers, d 128, batch 16 x 64) and of a
    GPT-2-small-shaped one (12 layers, d 768, batch 8 x 512, bf16 autocast):
    AdamW alone against Muon on the matrices (muon_param_groups) with AdamW on
    the rest, gradkit's and torch's. Each optimizer has its own copy of the
    model; the cases take turns for `rounds` rounds (a small model's step is
    bound by the host, whose speed drifts) and each keeps its best round's
    median."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
    import models

    configs = [("test GPT", dict(), 16, 64, False), ("GPT-2-small-shaped", dict(layers=12, d=768, heads=12, block=512),
                                                      8, 512, True)]
    for name, shape, batch, block, autocast in configs:
        x, y = next(models.text_batches("cuda", 1, batch=batch, block=block))

        def torch_muon(m):
            groups = gt.muon_param_groups(m)
            muon = torch.optim.Muon(groups[0]["params"], lr=0.02)
            adamw = torch.optim.AdamW(groups[1]["params"], lr=3e-4, fused=True)
            return [muon, adamw]

        optimizers = {"gradkit AdamW": lambda m: [gt.AdamW(m.parameters(), lr=3e-4)],
                      "torch fused AdamW": lambda m: [torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)],
                      "gradkit Muon + AdamW": lambda m: [gt.Muon(gt.muon_param_groups(m, lr=3e-4), lr=0.02)],
                      "torch Muon + fused AdamW": torch_muon}
        steps, hosts = {}, {}
        for label, make in optimizers.items():
            torch.manual_seed(0)
            model = models.TinyGPT(**shape).cuda()
            opts = make(model)
            step_host = hosts.setdefault(label, [])

            def step(model=model, opts=opts, step_host=step_host):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                t0 = time.perf_counter()
                for o in opts:
                    o.step()
                step_host.append((time.perf_counter() - t0) * 1e6)
                for o in opts:
                    o.zero_grad()
            steps[label] = step
        times = {label: float("inf") for label in steps}
        for _ in range(rounds):
            for label in steps:
                times[label] = min(times[label], median_ms(steps[label], reps))
        base = times["gradkit AdamW"]
        print(f"\n{name}: whole training step (forward, backward, clip, step), best of {rounds} rounds", flush=True)
        for label, ms in times.items():
            host = sorted(hosts[label])[len(hosts[label]) // 2]  # the optimizers' step() calls' own host time
            row = (name + " training step", label, f"{ms:.2f}", f"{host:.0f}", "", "", "",
                   f"{100 * (ms / base - 1):+.1f}% vs AdamW")
            rows.append(row)
            print("  ".join(f"{c:>{w}}" for c, w in zip(row, (28, 30, 8, 8, 1, 1, 1, 18))), flush=True)
        del steps
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lists", default="testgpt,gpt2,llama1b")
    parser.add_argument("--training", action="store_true", help="also whole training steps (bench_training)")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/torch_muon.py needs a CUDA device")
    if not hasattr(torch.optim, "Muon"):
        sys.exit(f"bench/torch_muon.py needs torch.optim.Muon (torch 2.9 or later; this is {torch.__version__})")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, python {sys.executable}")
    peak = matmul_tflops(args.reps)
    rows = []
    print("  ".join(f"{c:>{w}}" for c, w in zip(("list", "implementation", "ms", "host us", "TFLOP/s", "% meas",
                                                  "% spec", "vs torch"), (16, 44, 8, 8, 7, 8, 8, 7))))
    for key in filter(None, args.lists.split(",")):
        bench_list(key, args.reps, args.rounds, peak, rows)
    if args.training:
        bench_training(args.reps, max(args.rounds, 5), rows)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"bf16 matmul measured: {peak:.0f} TFLOP/s\n\n| list | implementation | ms | host us | TFLOP/s | "
                    "% measured matmul | % of 989 | vs torch.optim.Muon |\n|" + "---|" * 8 + "\n")
            f.writelines("| " + " | ".join(r) + " |\n" for r in rows)


if __name__ == "__main__":
    main()
