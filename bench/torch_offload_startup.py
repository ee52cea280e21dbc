#!/usr/bin/env python3
"""How long gradkit.torch.OffloadedAdamW and torchao's CPUOffloadOptimizer take
to start (issue 37: 74 s against torchao's 16 s for a 6.74B bf16 model):
making the optimizer, then its first step (a backward whose gradient hooks
hand the buckets, and step()), then a second step for reference. The
parameters are bf16 on the GPU, in the shapes of bench/offload_startup.cc
(layers of a width-4096 transformer, the rest in one tensor), --gib GiB in all.
Each case runs in a process of its own, so that neither finds the other's
memory (pinned or freed) on the host. Target: gradkit's making + first step at
most torchao's.
usage: bench/torch_offload_startup.py [--gib 2 8] [--cases gradkit,torchao]
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH = 4096


def shapes(gib):
    total = int(gib * 2**30 / 2)
    d = WIDTH
    layer = [3 * d * d, 3 * d, d * d, d, d, 4 * d * d, 4 * d, 4 * d * d]
    out, used = [], 0
    while used + sum(layer) <= total:
        out += layer
        used += sum(layer)
    if total > used:
        out.append(total - used)
    return out


def make(case, params):
    if case == "gradkit":
        import gradkit.torch as gt
        return gt.OffloadedAdamW(params, lr=1e-4, weight_decay=0.1)
    sys.path.insert(0, HERE)
    from torch_offload import torchao_offload  # torchao from the environment or .data/wheels
    import torch
    ao = torchao_offload()
    if ao is None:
        raise RuntimeError("torchao is not importable")
    return ao(params, torch.optim.AdamW, fused=True, lr=1e-4, weight_decay=0.1)


def one_case(case, gib):
    """Runs in the child: prints one JSON line of seconds."""
    import torch
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda", dtype=torch.bfloat16) * 0.02) for n in shapes(gib)]
    torch.cuda.synchronize()

    def step(opt):
        loss = sum(p.float().sum() for p in params) * 1e-3  # backward: the hooks hand the buckets
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    start = time.perf_counter()
    opt = make(case, params)
    torch.cuda.synchronize()
    made = time.perf_counter()
    step(opt)
    first = time.perf_counter()
    step(opt)
    second = time.perf_counter()
    print(json.dumps({"construct": made - start, "first": first - made, "second": second - first,
                      "params": sum(p.numel() for p in params), "tensors": len(params)}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--cases", default="gradkit,torchao")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_case(args.child, args.gib[0])
        return
    import torch
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("| GiB | case | parameters | tensors | make s | first step s | make + first step s | second step s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    status = 0
    for gib in args.gib:
        totals = {}
        for case in args.cases.split(","):
            run = subprocess.run([sys.executable, __file__, "--child", case, "--gib", str(gib)],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"| {gib:g} | {case} | failed: {(run.stderr.strip().splitlines() or ['?'])[-1]} | | | | | |")
                status = 1
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            totals[case] = r["construct"] + r["first"]
            print(f"| {gib:g} | {case} | {r['params'] / 1e9:.2f}B | {r['tensors']} | {r['construct']:.2f} "
                  f"| {r['first']:.2f} | {totals[case]:.2f} | {r['second']:.2f} |", flush=True)
        if "gradkit" in totals and "torchao" in totals:
            reached = "reached" if totals["gradkit"] <= totals["torchao"] else "NOT reached"
            print(f"{gib:g} GiB: target gradkit make + first step <= torchao's: {reached} "
                  f"({totals['gradkit'] / totals['torchao']:.2f}x)", flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
