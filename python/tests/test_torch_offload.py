"""gradkit.torch.OffloadedAdamW: the state on the host, the step on the CPU.

On a GPU: bit for bit the weights of gradkit.torch.AdamW stepping on the GPU
(gradkit's CPU and CUDA Adam give the same bits), through a real backward
with the hooks handing buckets (torch >= 2.1), with a loss scaler, clipping
and injected Inf/NaN against AmpStep, and through state_dict both ways. On
the CPU: the argument checks that need no GPU."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from conftest import cuda_visible  # noqa: E402
from models import TinyGPT, text_batches  # noqa: E402

needs_cuda = pytest.mark.skipif(not cuda_visible(), reason="no CUDA device visible")
needs_hooks = pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                                 reason="the hooks need torch >= 2.1")
SHAPES = [(17, 5), (33,), (4, 4, 3), (64, 8), (70000,)]


# -- arguments (any machine) -------------------------------------------------------

def test_params_on_the_cpu_are_refused():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    with pytest.raises(TypeError, match=r"params\[0\] is on cpu, expected a CUDA device"):
        gt.OffloadedAdamW(params)


def test_an_unknown_moment_form_is_refused_by_name():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    with pytest.raises(ValueError, match="moments is 'int2'"):
        gt.OffloadedAdamW(params, moments="int2")
    with pytest.raises(ValueError, match="moments is 'int2'"):
        gt.OffloadedLamb(params, moments="int2")


def test_the_native_optimizer_names_the_host_tensor():
    w, g = np.ones(8, dtype=np.float32), np.ones(8, dtype=np.float32)
    with pytest.raises(TypeError, match=r"groups\[0\].params\[0\].*is on cpu.*CUDA device"):
        gradkit.OffloadedAdam([{"params": [w], "grads": [g]}])
    assert (w == 1).all() and (g == 1).all()  # nothing written


# -- on a GPU ----------------------------------------------------------------------

def params_on(device, dtype=torch.float32, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device=device, dtype=dtype)) for s in SHAPES]


def grads_for(step, dtype, device, poison=False):
    g = torch.Generator().manual_seed(1000 + step)
    out = [(torch.randn(s, generator=g) * 1e-2).to(device=device, dtype=dtype) for s in SHAPES]
    if poison and step in (4, 11):
        out[1][3] = float("inf") if step == 4 else float("nan")
    return out


def two_groups(params):
    return [{"params": params[:2], "weight_decay": 0.05}, {"params": params[2:], "weight_decay": 0.0, "lr": 3e-3}]


@needs_cuda
def test_gpu_only_guards():
    p = params_on("cuda")
    with pytest.raises(ValueError, match="bucket_mb"):
        gt.OffloadedAdamW(p, bucket_mb=0)
    with pytest.raises(ValueError, match="piece_mb"):
        gt.OffloadedAdamW(p, piece_mb=0)
    opt = gt.OffloadedAdamW(p, bucket_mb=0.0001)
    for q, g in zip(p[:-1], grads_for(0, torch.float32, "cuda")):
        q.grad = g
    with pytest.raises(ValueError, match=r"params\[4\] has no gradient"):
        opt.step()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_adamw_on_the_gpu_bit_for_bit(dtype):
    a, b = params_on("cuda", dtype), params_on("cuda", dtype)
    off = gt.OffloadedAdamW(two_groups(a), lr=1e-2, bucket_mb=0.1)
    gpu = gt.AdamW(two_groups(b), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(off, step_size=5, gamma=0.5)
    gpu_sched = torch.optim.lr_scheduler.StepLR(gpu, step_size=5, gamma=0.5)
    assert off.native.num_buckets > 1
    for step in range(20):
        for p, q, g in zip(a, b, grads_for(step, dtype, "cuda")):
            p.grad, q.grad = g.clone(), g.clone()
        off.step()
        gpu.step()
        sched.step()
        gpu_sched.step()
        for p, q in zip(a, b):
            assert torch.equal(p.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               q.view(torch.int16 if dtype != torch.float32 else torch.int32)), step
    assert off.native.device_bytes < 4096  # no optimizer state on the GPU


@needs_cuda
@pytest.mark.parametrize("moments", ["bfloat16", "int8", "int4"])
def test_low_bit_host_moments_equal_adamw_on_the_gpu_and_move_between_them(moments):
    """Host moments in bfloat16, 8 or 4 bits: the same bits as gradkit.torch.AdamW's moments
    of that form on the GPU (every tensor quantized on both sides; the host cuts its pieces
    on whole blocks), and the state dicts load into each other, codes and all."""
    a, b = params_on("cuda"), params_on("cuda")
    off = gt.OffloadedAdamW(two_groups(a), lr=1e-2, bucket_mb=0.1, piece_mb=0.01, moments=moments)
    gpu = gt.AdamW(two_groups(b), lr=1e-2, moments=moments, min_8bit_size=0, min_4bit_size=0)
    for step in range(12):
        for p, q, g in zip(a, b, grads_for(step, torch.float32, "cuda")):
            p.grad, q.grad = g.clone(), g.clone()
        off.step()
        gpu.step()
        for i, (p, q) in enumerate(zip(a, b)):
            assert torch.equal(p.view(torch.int32), q.view(torch.int32)), (step, i)
    ours, theirs = off.state_dict(), gpu.state_dict()
    for i, key in enumerate(ours["state"]):
        for name, t in theirs["state"][key].items():
            assert torch.equal(ours["state"][key][name].cpu(), t.cpu()), (i, name)
    # Each loads the other's state (and float32 exports decode to the same values).
    back = gt.OffloadedAdamW(two_groups(a), lr=1e-2, moments=moments)
    back.load_state_dict(theirs)
    gpu.load_state_dict(off.state_dict())
    for key, s in back.state_dict()["state"].items():
        for name, t in ours["state"][key].items():
            assert torch.equal(s[name], t), (key, name)
    if moments == "int4":  # 4-bit codes of the linear map's time (unmarked): refused by both
        old = {**theirs, "state": {k: {n: v for n, v in s.items() if n != "int4_second_moment_map"}
                                   for k, s in theirs["state"].items()}}
        for opt in (back, gpu):
            with pytest.raises(ValueError, match="'int4_second_moment_map' None, expected 1 \\(DE-0\\)"):
                opt.load_state_dict(old)
    f_ours, f_theirs = off.float32_state_dict(), gpu.float32_state_dict()
    for key, s in f_ours["state"].items():
        assert s["exp_avg"].dtype == torch.float32
        assert torch.equal(s["exp_avg"], f_theirs["state"][key]["exp_avg"].cpu())
    assert off.native.device_bytes < 4096


@needs_cuda
def test_scaler_clipping_and_overflows_equal_ampstep():
    a, b = params_on("cuda"), params_on("cuda")
    scaler = gradkit.LossScalerOptions(initial_scale=1024.0, growth_interval=3)
    off = gt.OffloadedAdamW(two_groups(a), lr=1e-2, bucket_mb=0.1, loss_scaler=scaler, max_norm=0.05)
    gpu = gt.AdamW(two_groups(b), lr=1e-2)
    amp = gt.AmpStep(gpu, max_norm=0.05, init_scale=1024.0, growth_interval=3)
    skipped = 0
    for step in range(15):
        for p, q, g in zip(a, b, grads_for(step, torch.float32, "cuda", poison=True)):
            p.grad, q.grad = g.clone(), g.clone()
        off.step()
        amp.step()
        skipped += off.last_step_skipped
        for p, q in zip(a, b):
            assert torch.equal(p, q), step
        assert float(off.loss_scale) == amp.get_scale(), step
    assert skipped == 2


@needs_cuda
@needs_hooks
def test_a_real_backward_with_hooks_equals_the_gpu_step():
    train_side_by_side(lambda p: gt.OffloadedAdamW(p, lr=3e-3, bucket_mb=0.05), lambda p: gt.AdamW(p, lr=3e-3))


@needs_cuda
@needs_hooks
def test_an_lr_scheduler_applies_to_the_buckets_that_hooks_hand():
    """The buckets handed during backward step with the lr the scheduler set after the last step."""
    train_side_by_side(lambda p: gt.OffloadedAdamW(p, lr=3e-3, bucket_mb=0.05), lambda p: gt.AdamW(p, lr=3e-3),
                       lr_step=1, seed=1)


def train_side_by_side(make_offloaded, make_gpu, lr_step=None, seed=0):
    """Six bf16-autocast steps of a seeded TinyGPT with make_offloaded(its parameters) and of
    its copy with make_gpu(...): the weights equal bit for bit after each, and backward's hooks
    handed buckets. `lr_step`: a StepLR's step_size, each optimizer's scheduler stepped after
    each step (torch's order)."""
    torch.manual_seed(seed)
    model = TinyGPT(layers=2, d=64).cuda()
    ref = copy.deepcopy(model)
    off, gpu = make_offloaded(model.parameters()), make_gpu(ref.parameters())
    schedulers = {}
    if lr_step:
        schedulers = {id(o): torch.optim.lr_scheduler.StepLR(o, step_size=lr_step, gamma=0.5) for o in (off, gpu)}
    handed_early = 0
    for step, (x, y) in enumerate(text_batches("cuda", 6, batch=4, block=32)):
        for m, opt in ((model, off), (ref, gpu)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(x, y)
            loss.backward()
            if opt is off:
                handed_early += sum(off._handed)
            opt.step()
            opt.zero_grad()
            if schedulers:
                schedulers[id(opt)].step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), step
    assert handed_early > 0  # from the second step on, backward's hooks handed buckets


def run_steps(opt, params, steps, dtype=torch.float32):
    """grads_for(step)'s gradients and a step, for each of `steps`."""
    for step in steps:
        for p, g in zip(params, grads_for(step, dtype, "cuda")):
            p.grad = g
        opt.step()


@needs_cuda
def test_state_dict_moves_between_offloaded_gradkit_and_torch():
    run = run_steps

    straight = params_on("cuda")
    s_opt = gt.OffloadedAdamW(two_groups(straight), lr=1e-2)
    run(s_opt, straight, range(10))

    first = params_on("cuda")
    f_opt = gt.OffloadedAdamW(two_groups(first), lr=1e-2)
    run(f_opt, first, range(5))
    state = f_opt.state_dict()
    assert state["state"][0]["exp_avg"].device.type == "cpu"
    # into gradkit.torch.AdamW on the GPU, five steps there, and back
    gpu = gt.AdamW(two_groups(first), lr=1e-2)
    gpu.load_state_dict(state)
    run(gpu, first, range(5, 8))
    back = gt.OffloadedAdamW(two_groups(first), lr=1e-2)
    back.load_state_dict(gpu.state_dict())
    run(back, first, range(8, 10))
    for p, q in zip(straight, first):
        assert torch.equal(p, q)
    # torch.optim.AdamW takes the same dict
    t = torch.optim.AdamW(two_groups(params_on("cuda")), lr=1e-2)
    t.load_state_dict(back.state_dict())
    assert int(t.state[t.param_groups[0]["params"][0]]["step"]) == 10
    with pytest.raises(ValueError, match="params"):
        bad = back.state_dict()
        del bad["state"][3]
        back.load_state_dict(bad)
