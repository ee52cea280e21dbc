#!/usr/bin/env python3
"""The optimizer step and the mixed-precision step from PyTorch: gradkit.torch
against torch.optim in the same run, on the same parameter lists.

Lists: GPT-2 124M shapes (148 tensors), BERT-large (389), 10,000 small
tensors (2^10 to 2^16 elements, as gradkit bench's). For each:
- AdamW.step(): torch fused, torch foreach, gradkit (each .grad read per
  step), gradkit over flat gradients;
- the AMP sequence: torch's GradScaler.unscale_ + clip_grad_norm_ +
  GradScaler.step (fused AdamW) + update, against gradkit's AmpStep.step();
- host time of one step call (the call's wall time, no synchronization).
Then one whole training step (forward, backward, step) of a small GPT.

Device time is the median over --reps of CUDA events around the call (the
cases of a list measured in --rounds interleaved rounds, the best kept); bytes
are what the step must move at least (AdamW: read and write w, m, v, read g:
28 bytes per f32 element; the AMP step adds one read of g: 32), GB/s is
bytes / time, and % copy compares with a device-to-device copy measured in
the same run. With --profile FILE, the small GPT's steps are also run under
torch.profiler and each implementation's busiest operations (device and host
time, calls) written to FILE: where a whole step's time goes.
With --low-bit LISTS (default gpt2): AdamW.step() with 8-bit moments and
remainder masters on float32 and bfloat16 parameters, beside torch's fused
float32 AdamW and, where importable, bitsandbytes' AdamW8bit and torchao's
AdamW8bit and bf16 stochastic-rounding AdamW (put scripts/gpu carry's
.data/pylibs on PYTHONPATH), with the state each holds per parameter.
With --compiled LISTS (default gpt2): AdamW.step() and AmpStep.step() under
torch.compile (gradkit.torch._compile's operator; default mode and
mode="reduce-overhead") beside gradkit's eager step, torch's fused AdamW and
torch's compiled AdamW (foreach, capturable, a tensor lr: torch's recipe).
usage: bench/torch_step.py [--reps N] [--lists gpt2,bert,small] [--low-bit gpt2] [--compiled gpt2]
                           [--markdown FILE] [--profile FILE]
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
import gradkit.torch as gt  # noqa: E402
from timing import median_ms as device_ms  # noqa: E402  (bench/, the script's own folder)


def gpt2_shapes():
    d, shapes = 768, [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


def bert_large_shapes():
    h, i = 1024, 4096
    shapes = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(24):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (i, h), (i,), (h, i), (h,), (h,), (h,)]
    return shapes


def small_shapes(count=10000, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(int(2 ** (10 + 6 * float(u))),) for u in torch.rand(count, generator=g)]


LISTS = {"gpt2": ("GPT-2 124M", gpt2_shapes), "bert": ("BERT-large", bert_large_shapes),
         "small": ("10,000 small", small_shapes)}


def host_us(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()  # keep the queue short, so that the call never waits on it
    return statistics.median(times)


def copy_gbps(reps):
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ms = device_ms(lambda: b.copy_(a), reps)
    return 2 * a.numel() * 4 / ms / 1e6


def make_params(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-3
    return params


class Report:
    def __init__(self, copy):
        self.copy = copy
        self.rows = []

    def add(self, lst, what, impl, ms, host, nbytes, baseline=None):
        speedup = f"{baseline / ms:.2f}x" if baseline else ""
        # A whole training step (forward, backward, step) has no byte count of
        # its own: its bandwidth columns stay empty rather than printing nan.
        gbps = nbytes / ms / 1e6 if nbytes else None
        traffic = (f"{nbytes / 1e9:.3f}", f"{gbps:.0f}", f"{100 * gbps / self.copy:.1f}%") if nbytes else ("-", "-", "-")
        row = (lst, what, impl, f"{ms:.3f}", f"{host:.0f}" if host is not None else "", *traffic, speedup)
        self.rows.append(row)
        print("  ".join(f"{c:>{w}}" for c, w in zip(row, (12, 14, 24, 8, 8, 7, 6, 7, 7))), flush=True)

    def markdown(self):
        head = "| list | what | implementation | ms | host us | GB moved | GB/s | % copy | vs torch |\n|" + \
               "---|" * 9 + "\n"
        return head + "".join("| " + " | ".join(r) + " |\n" for r in self.rows)


def measure(cases, reps, rounds):
    """{name: (device ms, host us)} for each case, measured in `rounds` interleaved
    rounds (every case once per round, in order) and the best round's median kept:
    clocks and the allocator's state then favour no case."""
    best = {name: [math.inf, math.inf] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            best[name][0] = min(best[name][0], device_ms(fn, reps))
            best[name][1] = min(best[name][1], host_us(fn, reps))
    return best


def bench_list(key, reps, rounds, report):
    name, shapes_fn = LISTS[key]
    shapes = shapes_fn()
    params = make_params(shapes)
    flat_params = make_params(shapes, seed=1)
    numel = sum(p.numel() for p in params)
    print(f"\n{name}: {len(params)} tensors, {numel / 1e6:.1f}M parameters", flush=True)
    kw = dict(lr=1e-4, weight_decay=0.01)
    fused = torch.optim.AdamW(params, fused=True, **kw)
    foreach = torch.optim.AdamW(params, foreach=True, **kw)
    ours = gt.AdamW(params, **kw)
    flat_opt = gt.AdamW(flat_params, **kw)
    gt.flat_gradients(flat_params, flat_opt)
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0)
    scaler.scale(torch.ones((), device="cuda"))  # what scaling a loss does first: makes the scale tensor

    def torch_amp():
        scaler.unscale_(fused)
        torch.nn.utils.clip_grad_norm_(params, 1e9)
        scaler.step(fused)
        scaler.update()

    amp = gt.AmpStep(ours, max_norm=1e9, init_scale=1.0)
    amp_flat = gt.AmpStep(flat_opt, max_norm=1e9, init_scale=1.0)
    # (what, implementation, call, bytes it must move at least, the torch case it is compared with)
    cases = [("AdamW.step", "torch fused", fused.step, 28, None),
             ("AdamW.step", "torch foreach", foreach.step, 28, "torch fused"),
             ("AdamW.step", "gradkit", ours.step, 28, "torch fused"),
             ("AdamW.step", "gradkit, flat gradients", flat_opt.step, 28, "torch fused"),
             ("AMP step", "torch GradScaler+clip+fused", torch_amp, 48, None),
             ("AMP step", "gradkit AmpStep", amp.step, 32, "torch GradScaler+clip+fused"),
             ("AMP step", "gradkit AmpStep, flat", amp_flat.step, 32, "torch GradScaler+clip+fused")]
    times = measure({impl: fn for _, impl, fn, _, _ in cases}, reps, rounds)
    for what, impl, _, bytes_per_element, baseline in cases:
        ms, host = times[impl]
        report.add(name, what, impl, ms, host, bytes_per_element * numel, times[baseline][0] if baseline else None)
    del params, flat_params, fused, foreach, ours, flat_opt, amp, amp_flat, cases
    torch.cuda.empty_cache()


def bench_compiled(key, reps, rounds, report):
    """The step alone, compiled (gradkit's and torch's) beside the eager ones."""
    name, shapes_fn = LISTS[key]
    params = make_params(shapes_fn())
    numel = sum(p.numel() for p in params)
    print(f"\n{name} under torch.compile: {len(params)} tensors, {numel / 1e6:.1f}M parameters", flush=True)
    kw = dict(lr=1e-4, weight_decay=0.01)
    fused = torch.optim.AdamW(params, fused=True, **kw)
    compiled_torch = torch.optim.AdamW(params, foreach=True, capturable=True, lr=torch.tensor(1e-4, device="cuda"),
                                       weight_decay=0.01)
    ours = gt.AdamW(params, **kw)
    ours_ro = gt.AdamW(params, **kw)
    amp = gt.AmpStep(gt.AdamW(params, **kw), max_norm=1e9, init_scale=1.0)
    amp_eager = gt.AmpStep(gt.AdamW(params, **kw), max_norm=1e9, init_scale=1.0)
    # (implementation, call, bytes it must move at least, the case it is compared with)
    cases = [("torch fused", fused.step, 28, None),
             ("torch compiled (foreach, capturable)", torch.compile(compiled_torch.step), 28, "torch fused"),
             ("gradkit eager", ours.step, 28, "torch fused"),
             ("gradkit compiled", torch.compile(ours.step), 28, "torch compiled (foreach, capturable)"),
             ("gradkit reduce-overhead", torch.compile(lambda: ours_ro.step(), mode="reduce-overhead"), 28,
              "torch compiled (foreach, capturable)"),
             ("gradkit AmpStep eager", amp_eager.step, 32, "torch fused"),
             ("gradkit AmpStep compiled", torch.compile(lambda: amp.step()), 32, "torch fused")]
    for impl, fn, _, _ in cases:  # compile outside the timing
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"  {impl}: first 3 calls (compilation included) {time.perf_counter() - t0:.1f} s", flush=True)
    times = measure({impl: fn for impl, fn, _, _ in cases}, reps, rounds)
    # The same calls queued back to back (10 between two events): the host's cost of a call
    # then overlaps the work already queued, as in a training loop, where the step follows
    # backward's kernels; the one-call time above also counts the host's cost before the
    # first launch, with nothing queued.
    queued = measure({impl: (lambda fn=fn: [fn() for _ in range(10)]) for impl, fn, _, _ in cases},
                     max(reps // 4, 3), rounds)
    for impl, _, bytes_per_element, baseline in cases:
        ms, host = times[impl]
        report.add(name, "compiled step", impl, ms, host, bytes_per_element * numel,
                   times[baseline][0] if baseline else None)
    for impl, _, bytes_per_element, baseline in cases:
        ms = queued[impl][0] / 10
        report.add(name, "queued x10", impl, ms, None, bytes_per_element * numel,
                   queued[baseline][0] / 10 if baseline else None)
    for label, t in (("one call", times), ("queued", queued)):
        eager, compiled = t["gradkit eager"][0], t["gradkit compiled"][0]
        print(f"  targets ({label}): gradkit compiled {compiled:.3f} <= eager {eager:.3f}: "
              f"{'reached' if compiled <= eager * 1.02 else 'not reached'} (2% timing tolerance); "
              f"torch compiled / gradkit compiled = {t['torch compiled (foreach, capturable)'][0] / compiled:.2f}x "
              f"(target 1.4x)", flush=True)
    del params, fused, compiled_torch, ours, ours_ro, amp, amp_eager, cases
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def optional_optimizers():
    """bitsandbytes' and torchao's low-bit AdamW classes where importable ({} otherwise)."""
    found = {}
    try:
        import bitsandbytes as bnb
        found["bitsandbytes AdamW8bit"] = (bnb.__version__, bnb.optim.AdamW8bit)
    except Exception as e:  # not installed, or no binary for this CUDA
        print(f"    bitsandbytes not measured: {type(e).__name__}: {str(e)[:120]}", flush=True)
    try:
        import torchao
        from torchao.optim import AdamW4bit, AdamW8bit, _AdamW
        found["torchao AdamW8bit"] = (torchao.__version__, AdamW8bit)
        found["torchao AdamW4bit"] = (torchao.__version__, AdamW4bit)
        found["torchao _AdamW bf16 SR"] = (torchao.__version__, lambda p, **kw: _AdamW(p, bf16_stochastic_round=True,
                                                                                            **kw))
    except Exception as e:
        print(f"    torchao not measured: {type(e).__name__}: {str(e)[:120]}", flush=True)
    return found


def state_bytes_per_param(opt, params):
    """Device memory the optimizer's first step allocated (its state), per parameter."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_allocated() - before) / sum(p.numel() for p in params)


def bench_low_bit(key, reps, rounds, report):
    """AdamW.step() with 8-bit moments and remainder masters against torch's fused float32
    AdamW, bitsandbytes and torchao, on float32 and bfloat16 parameters (issue 24's table)."""
    name, shapes_fn = LISTS[key]
    shapes = shapes_fn()
    kw = dict(lr=1e-4, weight_decay=0.01)
    others = optional_optimizers()
    # (what, implementation, optimizer maker, bytes per element it must move at least, parameter dtype)
    rows = [("AdamW f32", "torch fused", lambda p: torch.optim.AdamW(p, fused=True, **kw), 28, torch.float32),
            ("AdamW f32", "gradkit", lambda p: gt.AdamW(p, **kw), 28, torch.float32),
            ("AdamW f32", "gradkit int8 moments", lambda p: gt.AdamW(p, moments="int8", **kw), 16, torch.float32),
            ("AdamW bf16", "gradkit f32 master", lambda p: gt.AdamW(p, **kw), 28, torch.bfloat16),
            ("AdamW bf16", "gradkit remainder", lambda p: gt.AdamW(p, master="remainder", **kw), 26, torch.bfloat16),
            ("AdamW bf16", "gradkit remainder int8",
             lambda p: gt.AdamW(p, master="remainder", moments="int8", **kw), 14, torch.bfloat16),
            ("AdamW f32", "gradkit int4 moments", lambda p: gt.AdamW(p, moments="int4", **kw), 14, torch.float32),
            ("AdamW bf16", "gradkit remainder int4",
             lambda p: gt.AdamW(p, master="remainder", moments="int4", **kw), 12, torch.bfloat16)]
    for impl, (version, cls) in others.items():
        if "bf16 SR" in impl:
            rows.append(("AdamW bf16", f"{impl} {version}", lambda p, c=cls: c(p, **kw), 14, torch.bfloat16))
            continue
        # The floor of each: f32 weights w 8, g 4, moments 2 (8-bit) or 1 (4-bit), read and
        # written; bf16 weights (no master) w 4, g 2 and the moments.
        moment_bytes = 1 if "4bit" in impl else 2
        rows.append(("AdamW f32", f"{impl} {version}", lambda p, c=cls: c(p, **kw), 12 + 2 * moment_bytes, torch.float32))
        rows.append(("AdamW bf16", f"{impl} {version}", lambda p, c=cls: c(p, **kw), 6 + 2 * moment_bytes,
                     torch.bfloat16))
    params = {torch.float32: make_params(shapes), torch.bfloat16: make_params(shapes, seed=2)}
    for p in params[torch.bfloat16]:
        p.data, p.grad = p.data.bfloat16(), p.grad.bfloat16()
    numel = sum(p.numel() for p in params[torch.float32])
    print(f"\n{name}, low-bit state: {len(shapes)} tensors, {numel / 1e6:.1f}M parameters", flush=True)
    cases, state = {}, {}
    for what, impl, make, _, dtype in rows:
        label = f"{what}: {impl}"
        try:
            opt = make(params[dtype])
            state[label] = state_bytes_per_param(opt, params[dtype])
        except Exception as e:  # a library that cannot step these parameters
            print(f"    {label} not measured: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        slow = "torchao" in impl  # about 0.1 s a step as called: fewer repetitions
        cases[label] = (opt.step, max(3, reps // 10) if slow else reps)
    times = {}
    for _ in range(rounds):
        for label, (fn, n) in cases.items():
            ms, host = device_ms(fn, n), host_us(fn, n)
            old = times.get(label, (math.inf, math.inf))
            times[label] = (min(old[0], ms), min(old[1], host))
    base = times.get("AdamW f32: torch fused", (None,))[0]
    for what, impl, _, bytes_per_element, _ in rows:
        label = f"{what}: {impl}"
        if label in times:
            report.add(name, what, impl, times[label][0], times[label][1], bytes_per_element * numel,
                       base if label != "AdamW f32: torch fused" else None)
    print("    optimizer state held (device memory its first step allocated), bytes per parameter:", flush=True)
    for label, b in state.items():
        print(f"      {label}: {b:.2f}", flush=True)
    del params, cases
    torch.cuda.empty_cache()


def profile_steps(steps, path, count=10):
    """Writes, per implementation, torch.profiler's table of `count` steps: the
    operations with the most device time, then the most host time."""
    from torch.profiler import ProfilerActivity, profile
    with open(path, "w") as f:
        for impl, step in steps.items():
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(count):
                    step()
                torch.cuda.synchronize()
            table = prof.key_averages()
            kernels = sum(e.count for e in table if e.device_type == torch.autograd.DeviceType.CUDA)
            f.write(f"## {impl}: {count} steps, {kernels} device activities (kernels, copies, memsets)\n\n")
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                f.write(table.table(sort_by=key, row_limit=15) + "\n")
    print(f"    profile of the small GPT's steps: {path}", flush=True)


def bench_training(reps, rounds, report, profile_path=None):
    import models
    name = "small GPT step"
    steps, optimizers = {}, {}
    for impl in ("torch fused", "gradkit", "gradkit, flat gradients"):
        torch.manual_seed(0)
        model = models.TinyGPT(layers=4, d=256, heads=8, block=128).cuda()
        if impl == "torch fused":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        else:
            opt = gt.AdamW(model.parameters(), lr=1e-3)
            if "flat" in impl:
                gt.flat_gradients(model, opt)
        batches = list(models.text_batches("cuda", 8, batch=32, block=128))

        def step(model=model, opt=opt, batches=batches, i=[0]):
            x, y = batches[i[0] % len(batches)]
            i[0] += 1
            opt.zero_grad()
            model(x, y).backward()
            opt.step()

        steps[impl], optimizers[impl] = step, opt
    numel = sum(p.numel() for p in model.parameters())
    times = measure(steps, reps, rounds)
    if profile_path:
        profile_steps(steps, profile_path)
    for impl in steps:
        report.add(name, f"{numel / 1e6:.1f}M params", impl, times[impl][0], times[impl][1], 0,
                   times["torch fused"][0] if impl != "torch fused" else None)
        opt = optimizers[impl]
        if impl != "torch fused":  # how often the gradients moved (zero_grad(set_to_none=True) frees them)
            print(f"    {impl}: plans made {opt._cohort_version} times, re-pointed "
                  f"{opt._pointer_version - opt._cohort_version} times", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best round's median is kept")
    parser.add_argument("--lists", default="gpt2,bert,small")
    parser.add_argument("--markdown", help="also write the table here")
    parser.add_argument("--profile", help="write torch.profiler tables of the small GPT's steps here")
    parser.add_argument("--compiled", default="gpt2", help="lists to step under torch.compile ('' for none)")
    parser.add_argument("--low-bit", default="gpt2",
                        help="lists to step with low-bit state (8-bit moments, remainder masters) beside "
                             "bitsandbytes and torchao where importable ('' for none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("torch_step.py needs a CUDA device", file=sys.stderr)
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.reps} reps, "
          f"best of {args.rounds} interleaved rounds")
    copy = copy_gbps(args.reps)
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
    report = Report(copy)
    for key in filter(None, args.lists.split(",")):
        bench_list(key, args.reps, args.rounds, report)
    for key in filter(None, args.compiled.split(",")):
        bench_compiled(key, args.reps, args.rounds, report)
    for key in filter(None, args.low_bit.split(",")):
        bench_low_bit(key, args.reps, args.rounds, report)
    if args.lists:  # --lists "": the low-bit table alone
        bench_training(args.reps, args.rounds, report, args.profile)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                    f"copy {copy:.0f} GB/s\n\n" + report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
