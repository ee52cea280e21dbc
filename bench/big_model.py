#!/usr/bin/env python3
"""How large a Llama-shaped model trains on one GPU, and how fast, with each optimizer (issue 37).

Models: transformers' LlamaForCausalLM, random weights (nothing downloaded), made
directly on the GPU in bfloat16 (float32 for torch-f32), activation checkpointing
on, batch --batch x --seq random tokens (default 8 x 2048), vocabulary 32000.
Width d, layers L, d/128 heads, MLP width int(8d/3) rounded up to a multiple of
256 (11008 for d4096, as Llama). Named sizes (exact parameter counts are printed):

  350m d1024 L24 | 1.3b d2048 L24 | 6.7b d4096 L32 | 13b d4096 L64 | 20b d5120 L62
  | 30b d6656 L60 (Llama 33B's shape); or any dDxLN, e.g. d4096xL48.

Configurations (--configs):

  fwdbwd           forward + backward alone, each gradient dropped as it is made
                   (a post-accumulate-grad hook sets p.grad = None): the ceiling
  torch-f32        torch.optim.AdamW(fused=True), float32 parameters, bf16 autocast
  torch-bf16       torch.optim.AdamW(fused=True) on the bf16 parameters
  bnb8bit          bitsandbytes.optim.AdamW8bit on the bf16 parameters
  torchao          torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)
  torchao-release  the same with offload_gradients=True (GPU gradients freed once copied)
  gradkit-int8     gradkit.torch.AdamW(moments="int8", master="remainder") on the GPU
  gradkit-offload  gradkit.torch.OffloadedAdamW(moments=--offload-moments, default int8)
  gradkit-release  the same with release=True (each bucket's GPU gradients freed once
                   copied to the host)

Each (configuration, size) runs in a process of its own (a crash or an out-of-memory
ends only that run, and each starts with clean memory). Per configuration the sizes
run smallest first, and the first size that fails ends that configuration: the
summary names the largest size that trains and what stopped the next one. The
gradkit offload runs get OMP_NUM_THREADS=1, as docs/offload.md recommends.

Measured per run: the setup time (optimizer constructor start to the first step()
returned, synchronized; the constructor alone beside it); then --warmup untimed and
--steps timed steps, each zero_grad(set_to_none=True), forward, loss.backward(),
optimizer.step(), with torch.cuda.synchronize() around the timed loop (per-step,
forward+backward and after-backward times from CUDA events recorded between the
steps). Reported: ms/step, tokens/s, model FLOP utilisation (6 * parameters *
tokens / time over --peak-tflops, default the H100 SXM's dense bf16 989 TFLOP/s;
the recomputation of checkpointing is not counted), peak GPU memory (allocated and
reserved), the peak host RSS, the optimizer's host memory (gradkit:
optimizer.native.host_bytes; torchao: its pinned copies and CPU state), and the
ratio to fwdbwd's ms/step at the same size when fwdbwd ran in the same invocation.

Output: a markdown table on stdout (and --markdown FILE), one JSON line per run in
--json (default $OUT/big_model.jsonl when $OUT is set), each run's log in --log-dir
(default $OUT/big_model-logs).

Run it on a GPU machine through scripts/gpu offload big (builds the Python module,
puts .data/pylibs on PYTHONPATH for bitsandbytes and torchao). The offloaded
optimizers keep 8 bytes per parameter in host memory with int8 moments, 10 with
bfloat16 ones (torchao about 8), so the 13b and larger sizes want the 2-GPU machine kind's 251 GiB of host memory; one GPU
is used. For example:

  scripts/gpu offload big --sizes 6.7b,13b --configs fwdbwd,gradkit-offload,gradkit-release,torchao
  python3 bench/big_model.py --sizes 1.3b,d4096xL8 --configs fwdbwd,torch-bf16 --steps 5
  python3 bench/big_model.py --dry-run --sizes 1.3b,6.7b,13b,20b,30b   # the size table, no GPU
"""
import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
H100_DENSE_BF16_TFLOPS = 989.0  # NVIDIA's H100 SXM datasheet, dense (no sparsity)
VOCAB = 32000
HEAD_DIM = 128
GIB = 2 ** 30

# name: (width d, layers L)
NAMED_SIZES = {"350m": (1024, 24), "1.3b": (2048, 24), "6.7b": (4096, 32), "13b": (4096, 64),
               "20b": (5120, 62), "30b": (6656, 60)}

CONFIGS = {
    "fwdbwd": "forward + backward, gradients dropped as made, no optimizer",
    "torch-f32": "torch AdamW fused, float32 parameters, bf16 autocast",
    "torch-bf16": "torch AdamW fused, bf16 parameters",
    "bnb8bit": "bitsandbytes AdamW8bit, bf16 parameters",
    "torchao": "torchao CPUOffloadOptimizer(AdamW fused), bf16 parameters",
    "torchao-release": "torchao CPUOffloadOptimizer(AdamW fused, offload_gradients=True), bf16 parameters",
    "gradkit-int8": "gradkit AdamW, int8 moments, remainder masters, bf16 parameters",
    "gradkit-offload": "gradkit OffloadedAdamW, bf16 parameters",
    "gradkit-release": "gradkit OffloadedAdamW(release=True), bf16 parameters",
}
OMP_ONE_THREAD = ("gradkit-offload", "gradkit-release")  # docs/offload.md: torch's OpenMP pool competes
DEFAULT_CONFIGS = "fwdbwd,torch-f32,torch-bf16,bnb8bit,torchao,gradkit-int8,gradkit-offload,gradkit-release"
LR, WEIGHT_DECAY = 1e-5, 0.1  # small: random weights and tokens must not diverge within a few steps


# -- sizes ---------------------------------------------------------------------------------

class Size:
    """A Llama shape: width d, layers L, Llama's MLP width, d/128 heads, vocabulary 32000."""

    def __init__(self, name, d, layers):
        if d <= 0 or d % HEAD_DIM or layers <= 0:
            raise ValueError(f"size {name}: width {d} must be a positive multiple of {HEAD_DIM} "
                             f"(heads of {HEAD_DIM}) and layers {layers} positive")
        self.name, self.d, self.layers = name, d, layers
        self.heads = d // HEAD_DIM
        self.intermediate = math.ceil(int(8 * d / 3) / 256) * 256  # 11008 for d4096, as Llama
        self._params = None

    def config(self, seq):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCAB, hidden_size=self.d, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.heads, max_position_embeddings=max(2048, seq),
                           tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")

    @property
    def params(self):
        """The exact parameter count, from the model built on the meta device (no memory)."""
        if self._params is None:
            import torch
            from transformers import LlamaForCausalLM

            with torch.device("meta"):
                model = LlamaForCausalLM(self.config(2048))
            self._params = sum(p.numel() for p in model.parameters())
        return self._params

    def shape(self):
        return f"d{self.d} L{self.layers} mlp{self.intermediate} heads{self.heads}"


def parse_size(text):
    text = text.strip()
    if text.lower() in NAMED_SIZES:
        return Size(text.lower(), *NAMED_SIZES[text.lower()])
    m = re.fullmatch(r"d(\d+)xL(\d+)", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected one of {', '.join(NAMED_SIZES)} or dDxLN "
                                         "(e.g. d4096xL32)")
    return Size(f"d{m[1]}xL{m[2]}", int(m[1]), int(m[2]))


# -- the child: one configuration at one size --------------------------------------------

class Skip(Exception):
    """The configuration cannot run here (a library missing): not a failure of the size."""


def torchao_cpu_offload():
    """torchao.optim.CPUOffloadOptimizer: from PYTHONPATH (.data/pylibs), else from the wheel in
    .data/wheels the way bench/torch_offload.py unpacks it."""
    try:
        from torchao.optim import CPUOffloadOptimizer
        return CPUOffloadOptimizer
    except ImportError as e:
        first = e
    sys.path.insert(0, HERE)
    from torch_offload import torchao_offload  # imports gradkit.torch too

    cls = torchao_offload()
    if cls is None:
        raise Skip(f"torchao does not import ({type(first).__name__}: {first}) and no usable wheel in .data/wheels")
    return cls


def check_available(config):
    """Imports what the configuration needs before the model is built; Skip if it is missing."""
    if config == "bnb8bit":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # ImportError, or its CUDA library failing to load
            raise Skip(f"bitsandbytes does not import: {type(e).__name__}: {str(e)[:200]}")
    elif config.startswith("torchao"):
        torchao_cpu_offload()
    elif config.startswith("gradkit"):
        import gradkit.torch  # noqa: F401  (a failure here is an error: gradkit is what is measured)


@contextlib.contextmanager
def default_dtype(dtype):
    """torch's default dtype set to `dtype` within."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def skip_hf_init():
    """transformers' no_init_weights (its location moved between versions), else nothing."""
    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(where, fromlist=["no_init_weights"])
            return module.no_init_weights()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


def build_model(size, dtype, device, seq, seed):
    """LlamaForCausalLM made directly on `device` in `dtype` (no float32 copy on the host),
    transformers' initialisation skipped and replaced by one normal_ (std 0.02) per matrix and
    ones for the norms, on the device; checkpointing on, training mode."""
    import torch
    from transformers import LlamaForCausalLM

    with default_dtype(dtype), torch.device(device), skip_hf_init():
        model = LlamaForCausalLM(size.config(seq))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights
    wrong = {(p.dtype, p.device.type) for p in model.parameters()} - {(dtype, torch.device(device).type)}
    if wrong:
        raise RuntimeError(f"model parameters are {wrong}, expected {dtype} on {device}")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def make_optimizer(config, params, args):
    """The configuration's optimizer over `params` (None for fwdbwd)."""
    import torch

    if config == "fwdbwd":
        return None
    if config in ("torch-f32", "torch-bf16"):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    if config == "bnb8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)
    if config in ("torchao", "torchao-release"):
        return torchao_cpu_offload()(params, torch.optim.AdamW, fused=True, lr=LR, weight_decay=WEIGHT_DECAY,
                                     offload_gradients=config == "torchao-release")
    import gradkit.torch as gt
    if config == "gradkit-int8":
        return gt.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, moments="int8", master="remainder")
    if config in ("gradkit-offload", "gradkit-release"):
        options = {"moments": args.offload_moments}
        for name in ("bucket_mb", "piece_mb", "host_threads"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
        if config == "gradkit-release":
            options["release"] = True
        return gt.OffloadedAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **options)
    raise ValueError(f"unknown configuration {config!r}")


def optimizer_host_bytes(config, opt):
    """The host memory the offloaded optimizer holds (None for the others)."""
    if config.startswith("gradkit") and hasattr(opt, "native") and hasattr(opt.native, "host_bytes"):
        return int(opt.native.host_bytes)
    if config.startswith("torchao"):  # pinned weight and gradient copies, and the CPU AdamWs' state
        total = sum(h.nbytes + (h.grad.nbytes if h.grad is not None else 0) for h in opt.param_d2h_map.values())
        for inner in opt.optim_dict.values():
            for state in inner.state.values():
                total += sum(v.nbytes for v in state.values() if hasattr(v, "nbytes") and v.device.type == "cpu")
        return total
    return None


class Clock:
    """Marks in stream order: CUDA events on a GPU, perf_counter on the CPU (smoke runs)."""

    def __init__(self, cuda):
        self.cuda = cuda

    def mark(self):
        import torch
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()


def train_step(model, opt, ids, autocast, clock):
    """zero_grad, forward, backward, step; returns (mark before, mark after backward, loss)."""
    import torch

    start = clock.mark()
    if opt is not None:
        opt.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    after_backward = clock.mark()
    if opt is not None:
        opt.step()
    return start, after_backward, loss


def is_oom(e):
    """torch's OutOfMemoryError, or another library's error saying so (a failed pinned allocation)."""
    import torch
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    text = str(e).lower()
    return isinstance(e, oom_type) or "out of memory" in text or "cudaerrormemoryallocation" in text


def run_child(args):
    """One configuration at one size; writes its result (JSON) to args.result_file at each phase, so
    that a run killed from outside still says how far it got, and leaves with os._exit."""
    size = parse_size(args.child[1])
    config = args.child[0]
    result = {"config": config, "size": size.name, "d": size.d, "layers": size.layers,
              "intermediate": size.intermediate, "heads": size.heads, "batch": args.batch, "seq": args.seq,
              "warmup": args.warmup, "steps": args.steps, "status": "running", "phase": "import",
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if config in ("gradkit-offload", "gradkit-release"):
        result["offload_moments"] = args.offload_moments

    def save():
        tmp = args.result_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result_file)

    def phase(name):
        result["phase"] = name
        print(f"[{time.strftime('%H:%M:%S')}] {config} {size.name}: {name}", flush=True)
        save()

    t_start = time.perf_counter()
    code = 0
    cuda = False
    try:
        import torch
        cuda = args.device.startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible")
        result.update(torch=torch.__version__,
                      device_name=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu")
        check_available(config)
        import transformers  # noqa: F401  (imported before the model's build is timed)
        phase("building the model")
        dtype = torch.float32 if config == "torch-f32" else torch.bfloat16
        t0 = time.perf_counter()
        model = build_model(size, dtype, args.device, args.seq, args.seed)
        params = [p for p in model.parameters()]
        n = sum(p.numel() for p in params)
        clock = Clock(cuda)
        clock.sync()
        result.update(params=n, param_dtype=str(dtype).replace("torch.", ""),
                      model_build_s=time.perf_counter() - t0)
        if cuda:
            result["gpu_after_model_gib"] = torch.cuda.memory_allocated() / GIB
        if config == "fwdbwd":
            def drop(p):
                p.grad = None
            for p in params:
                p.register_post_accumulate_grad_hook(drop)

        gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
        batches = [torch.randint(0, VOCAB, (args.batch, args.seq), device=args.device, generator=gen)
                   for _ in range(1 + args.warmup + args.steps)]
        autocast = config == "torch-f32"

        phase("optimizer construction and first step")
        clock.sync()
        t0 = time.perf_counter()
        opt = make_optimizer(config, params, args)
        result["ctor_s"] = time.perf_counter() - t0 if opt is not None else None
        train_step(model, opt, batches[0], autocast, clock)
        clock.sync()
        result["setup_s"] = time.perf_counter() - t0
        result["opt_host_bytes"] = optimizer_host_bytes(config, opt)
        if config in ("gradkit-offload", "gradkit-release"):
            result["releases_gradients"] = getattr(opt.native, "releases_gradients", None)

        phase(f"{args.warmup} warm-up steps")
        for ids in batches[1:1 + args.warmup]:
            train_step(model, opt, ids, autocast, clock)

        phase(f"{args.steps} timed steps")
        marks = []
        clock.sync()
        t0 = time.perf_counter()
        for ids in batches[1 + args.warmup:]:
            start, after_backward, loss = train_step(model, opt, ids, autocast, clock)
            marks.append((start, after_backward))
        end = clock.mark()
        clock.sync()
        wall_s = time.perf_counter() - t0
        starts = [m[0] for m in marks] + [end]
        tokens = args.batch * args.seq
        ms = wall_s * 1e3 / args.steps
        result.update(
            ms_per_step=ms,
            step_ms=[clock.ms(starts[i], starts[i + 1]) for i in range(args.steps)],
            fwd_bwd_ms=[clock.ms(m[0], m[1]) for m in marks],
            after_bwd_ms=[clock.ms(marks[i][1], starts[i + 1]) for i in range(args.steps)],
            tokens_per_s=tokens / (ms / 1e3),
            mfu=6 * n * tokens / (ms / 1e3) / (args.peak_tflops * 1e12),
            loss=float(loss.detach()),
            # gradients still on the GPU after a step (before the next zero_grad): 0 with release
            grads_alive_after_step=sum(p.grad is not None for p in params),
            status="ok", phase="done")
    except Skip as e:
        result.update(status="skipped", reason=str(e))
    except BaseException as e:  # noqa: B036 (KeyboardInterrupt too: say where it stopped)
        oom = is_oom(e)
        result.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {str(e)[:600]}")
        traceback.print_exc()
        code = 0 if oom else 1
    if cuda:
        result.update(gpu_peak_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                      gpu_peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                      gpu_total_gib=torch.cuda.get_device_properties(0).total_memory / GIB)
    result["host_rss_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    result["child_s"] = time.perf_counter() - t_start
    save()
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # Nothing to tear down: after a failed step an offloaded optimizer may still hold handed
    # buckets, and freeing 100+ GiB of pinned memory one buffer at a time is the OS's job.
    os._exit(code)


# -- the parent ----------------------------------------------------------------------------

def probe_device(python):
    """The GPU's name and memory from a short process of its own (the parent keeps no CUDA context)."""
    code = ("import json, torch; p = torch.cuda.get_device_properties(0); "
            "print(json.dumps({'name': p.name, 'memory_gib': p.total_memory / 2**30, 'sm': f'{p.major}.{p.minor}', "
            "'count': torch.cuda.device_count(), 'cuda': torch.version.cuda}))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=180)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as e:
        return {"name": f"unknown ({type(e).__name__})"}


def host_memory():
    """MemTotal and the cgroup's limit, in GiB (either None where unreadable)."""
    total = limit = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024 / GIB
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                text = f.read().strip()
            if text != "max" and int(text) < 2 ** 60:
                limit = int(text) / GIB
            break
    return total, limit


def child_command(args, config, size, result_file):
    argv = [sys.executable, os.path.abspath(__file__), "--child", config, size.name, "--result-file", result_file,
            "--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--peak-tflops", str(args.peak_tflops), "--seed", str(args.seed),
            "--offload-moments", args.offload_moments, "--device", args.device]
    for name in ("bucket_mb", "piece_mb", "host_threads"):
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv


def run_one(args, config, size, log_dir, timeout):
    """Runs one child; returns its result (from its result file, or made from its exit)."""
    log_path = os.path.join(log_dir, f"{config}-{size.name}.log")
    result_file = os.path.join(log_dir, f"{config}-{size.name}.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(result_file)
    env = dict(os.environ)
    if config in OMP_ONE_THREAD:
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(child_command(args, config, size, result_file), stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=os.path.dirname(HERE))
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()  # the child is one process (gradkit's and torch's workers are its threads)
            rc = proc.wait()
    wall = time.perf_counter() - t0
    result = {"config": config, "size": size.name, "params": size.params, "status": "crashed"}
    with contextlib.suppress(OSError, ValueError):
        with open(result_file) as f:
            result.update(json.load(f))
    result.update(params=size.params, wall_s=wall, rc=rc, log=log_path)
    if timed_out:
        result.update(status="timeout", error=f"no result within {timeout:.0f} s (phase: {result.get('phase')})")
    elif result["status"] in ("running", "crashed"):  # it died without writing its end
        why = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        hint = " (SIGKILL: the host out of memory?)" if rc == -9 else ""
        result.update(status="crashed", error=f"{why}{hint} during: {result.get('phase', 'start')}")
    return result


def gib(x):
    return "-" if x is None else f"{x:.1f}"


def describe_failure(r):
    if r["status"] == "oom":
        return (f"out of memory during {r.get('phase')} (GPU peak {gib(r.get('gpu_peak_alloc_gib'))} GiB allocated, "
                f"host RSS peak {gib(r.get('host_rss_peak_gib'))} GiB): {r.get('error', '')[:300]}")
    if r["status"] == "skipped":
        return f"skipped: {r.get('reason')}"
    return f"{r['status']}: {r.get('error', '')[:300]}"


def table(results):
    """The markdown table: one row per run."""
    fwdbwd = {r["size"]: r["ms_per_step"] for r in results if r["config"] == "fwdbwd" and r["status"] == "ok"}
    rows = ["| config | size | parameters | status | ms / step | tokens / s | MFU | x fwdbwd | fwd+bwd ms "
            "| after bwd ms | ctor s | ctor + 1st step s | GPU peak alloc / reserved GiB | host RSS peak GiB "
            "| optimizer host GiB |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        cells = [r["config"], r["size"], f"{r['params'] / 1e9:.3f}B"]
        if r["status"] == "ok":
            mean = lambda key: sum(r[key]) / len(r[key])  # noqa: E731
            ratio = f"{r['ms_per_step'] / fwdbwd[r['size']]:.2f}" if r["size"] in fwdbwd else "-"
            cells += ["ok", f"{r['ms_per_step']:.0f}", f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%", ratio,
                      f"{mean('fwd_bwd_ms'):.0f}", f"{mean('after_bwd_ms'):.0f}"]
        else:
            cells += [describe_failure(r)[:70].replace("|", "/")] + ["-"] * 6
        cells += [f"{r['ctor_s']:.1f}" if r.get("ctor_s") is not None else "-",
                  f"{r['setup_s']:.1f}" if r.get("setup_s") is not None else "-",
                  f"{gib(r.get('gpu_peak_alloc_gib'))} / {gib(r.get('gpu_peak_reserved_gib'))}",
                  gib(r.get("host_rss_peak_gib")),
                  gib(r["opt_host_bytes"] / GIB) if r.get("opt_host_bytes") is not None else "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def write_markdown(path, meta, text):
    if path:
        with open(path, "w") as f:
            f.write(f"{meta['date']}, {meta['device'].get('name')}, torch {meta['torch']}, host memory "
                    f"{gib(meta['host_mem_total_gib'])} GiB; command: `{meta['command']}`\n\n{text}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="configurations:\n" + "\n".join(f"  {k:17} {v}" for k, v in CONFIGS.items())
                                     + "\nsizes: " + ", ".join(f"{k} (d{d} L{n})" for k, (d, n) in NAMED_SIZES.items())
                                     + ", or dDxLN (e.g. d4096xL32)")
    parser.add_argument("--sizes", default="1.3b,6.7b,13b,20b,30b",
                        help="comma list of sizes, run smallest first (default: %(default)s)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed "
                        "(default: %(default)s)")
    parser.add_argument("--time-budget", type=float, default=0, help="seconds for the whole benchmark: no run starts "
                        "with less than 60 s left, and runs are cut at the end of it (default: 0, no budget)")
    parser.add_argument("--peak-tflops", type=float, default=H100_DENSE_BF16_TFLOPS,
                        help="the GPU's dense bf16 peak for MFU (default: H100 SXM, %(default)s)")
    parser.add_argument("--offload-moments", default="int8", choices=["float32", "bfloat16", "int8"],
                        help="gradkit-offload/-release host moments (default: %(default)s)")
    parser.add_argument("--bucket-mb", type=float, help="gradkit offload bucket_mb (default: the library's)")
    parser.add_argument("--piece-mb", type=float, help="gradkit offload piece_mb (default: the library's)")
    parser.add_argument("--host-threads", type=int, help="gradkit offload host_threads (default: the library's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=os.path.join(os.environ["OUT"], "big_model.jsonl") if os.environ.get("OUT")
                        else None, help="JSON lines file (default: $OUT/big_model.jsonl when $OUT is set)")
    parser.add_argument("--log-dir", default=os.path.join(os.environ["OUT"], "big_model-logs")
                        if os.environ.get("OUT") else None,
                        help="each run's log and result (default: $OUT/big_model-logs, else a temporary folder)")
    parser.add_argument("--markdown", help="also write the table and summary to this file")
    parser.add_argument("--dry-run", action="store_true", help="print the header, the sizes and the runs planned; "
                        "run nothing (no GPU needed)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the child's path for a smoke "
                        "check only (tiny sizes, no GPU figures)")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "SIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 0 or args.steps < 1 or args.batch < 1 or args.seq < 2:
        parser.error("need --warmup >= 0, --steps >= 1, --batch >= 1, --seq >= 2")
    if args.child:
        return run_child(args)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    try:
        sizes = sorted((parse_size(s) for s in args.sizes.split(",") if s.strip()), key=lambda s: s.params)
    except (argparse.ArgumentTypeError, ValueError) as e:
        parser.error(str(e))

    import torch  # no CUDA context here: the children hold the GPU

    cuda = args.device.startswith("cuda")
    device = probe_device(sys.executable) if cuda and not args.dry_run else {"name": args.device}
    mem_total, mem_limit = host_memory()
    tokens = args.batch * args.seq
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in sys.argv), "device": device, "torch": torch.__version__,
            "python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
            "host_mem_total_gib": mem_total, "host_mem_limit_gib": mem_limit, "batch": args.batch, "seq": args.seq,
            "warmup": args.warmup, "steps": args.steps, "peak_tflops": args.peak_tflops,
            "offload_moments": args.offload_moments, "omp_one_thread": list(OMP_ONE_THREAD),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    with contextlib.suppress(ImportError):
        import transformers
        meta["transformers"] = transformers.__version__
    print(f"# bench/big_model.py, {meta['date']}")
    print(f"command: {meta['command']}")
    print(f"device: {device.get('name')} ({gib(device.get('memory_gib'))} GiB, {device.get('count', '?')} visible, "
          f"one used), CUDA {device.get('cuda', '?')}; torch {torch.__version__}, transformers "
          f"{meta.get('transformers', '?')}, Python {meta['python']}")
    print(f"host: {platform.node()}, {os.cpu_count()} CPUs, MemTotal {gib(mem_total)} GiB, cgroup limit "
          f"{gib(mem_limit) if mem_limit else 'none'} GiB (on some machine kinds MemTotal grows as memory is used)")
    print(f"steps: batch {args.batch} x {args.seq} tokens = {tokens} tokens, activation checkpointing, "
          f"1 + {args.warmup} untimed + {args.steps} timed steps; MFU = 6 * parameters * tokens / time over "
          f"{args.peak_tflops:.0f} TFLOP/s (dense bf16 peak)")
    print(f"OMP_NUM_THREADS=1 in the runs of {', '.join(c for c in OMP_ONE_THREAD if c in configs) or '(none here)'}"
          " (docs/offload.md); gradkit offload moments: " + args.offload_moments)
    print()
    print("| size | shape | parameters | bf16 weights GiB |")
    print("| --- | --- | ---: | ---: |")
    for s in sizes:
        print(f"| {s.name} | {s.shape()} | {s.params:,} | {s.params * 2 / GIB:.1f} |")
    print()
    if args.dry_run:
        for c in configs:
            print(f"would run {c}: {', '.join(s.name for s in sizes)} (each in its own process, stopping at the first "
                  "that fails)")
        return 0

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="big_model-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"logs: {log_dir}" + (f"; JSON lines: {args.json}" if args.json else ""))
    jsonl = open(args.json, "w") if args.json else None
    if jsonl:
        jsonl.write(json.dumps({"type": "meta", **meta}) + "\n")
        jsonl.flush()
    start = time.perf_counter()
    results, summary = [], []
    for config in configs:
        largest, stop = None, None
        for size in sizes:
            timeout = args.timeout
            if args.time_budget:
                left = args.time_budget - (time.perf_counter() - start)
                if left < 60:
                    stop = f"{size.name} not run: the time budget ({args.time_budget:.0f} s) is spent"
                    break
                timeout = min(timeout, left)
            print(f"[{time.strftime('%H:%M:%S')}] {config} {size.name} ({size.params / 1e9:.2f}B) ...", flush=True)
            r = run_one(args, config, size, log_dir, timeout)
            results.append(r)
            if jsonl:
                jsonl.write(json.dumps({"type": "run", **r}) + "\n")
                jsonl.flush()
            write_markdown(args.markdown, meta, "\n".join(table(results)))  # so far: a cut-off run keeps it
            if r["status"] == "ok":
                largest = size
                print(f"    {r['ms_per_step']:.0f} ms/step, {r['tokens_per_s']:.0f} tokens/s, MFU "
                      f"{100 * r['mfu']:.1f}%, setup {r['setup_s']:.1f} s, GPU peak "
                      f"{gib(r.get('gpu_peak_alloc_gib'))} GiB, host RSS peak {gib(r['host_rss_peak_gib'])} GiB "
                      f"({r['wall_s']:.0f} s)", flush=True)
            else:
                stop = f"{size.name}: {describe_failure(r)}"
                print(f"    {describe_failure(r)} ({r['wall_s']:.0f} s; log {r['log']})", flush=True)
                if r["status"] not in ("oom", "skipped"):
                    with contextlib.suppress(OSError):
                        with open(r["log"]) as f:
                            lines = [line for line in f.read().splitlines() if not line.startswith("{")]
                        print("      " + "\n      ".join(lines[-8:]))
                break
        summary.append(f"- {config}: largest size that trains: "
                       f"{f'{largest.name} ({largest.params / 1e9:.2f}B)' if largest else 'none'}"
                       + (f"; stopped at {stop}" if stop else "; every size asked for trained"))
    if jsonl:
        jsonl.close()
    text = "\n".join(table(results) + [""] + summary)
    print()
    print(text)
    write_markdown(args.markdown, meta, text)
    return 1 if any(r["status"] in ("error", "crashed") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
