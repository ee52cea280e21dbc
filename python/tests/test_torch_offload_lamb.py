"""gradkit.torch.OffloadedLamb: LAMB with the state on the host, the step on the CPU.

On a GPU: bit for bit the weights of gradkit.torch.Lamb stepping on the GPU
(gradkit's CPU and CUDA LAMB give the same bits, and an offloaded piece holds
whole tensors, so each tensor's norms are summed as on the GPU), through a
real backward with the hooks handing buckets (torch >= 2.1), and through
state_dict both ways. On the CPU: the argument checks that need no GPU."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from conftest import cuda_visible  # noqa: E402
from models import TinyGPT, text_batches  # noqa: E402
from test_torch_offload import grads_for, params_on  # noqa: E402

needs_cuda = pytest.mark.skipif(not cuda_visible(), reason="no CUDA device visible")


def two_groups(params):
    """Two groups that differ in everything LAMB keeps per group (eta is shared)."""
    return [{"params": params[:2], "weight_decay": 0.05, "max_trust": 5.0},
            {"params": params[2:], "weight_decay": 0.0, "betas": (0.8, 0.99)}]


# -- arguments (any machine) -------------------------------------------------------

def test_params_on_the_cpu_are_refused():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    with pytest.raises(TypeError, match=r"params\[0\] is on cpu, expected a CUDA device"):
        gt.OffloadedLamb(params)


def test_the_native_optimizer_names_its_arguments():
    w, g = np.ones(8, dtype=np.float32), np.ones(8, dtype=np.float32)
    with pytest.raises(TypeError, match=r"OffloadedLamb.*groups\[0\].params\[0\].*is on cpu.*CUDA device"):
        gradkit.OffloadedLamb([{"params": [w], "grads": [g]}])
    with pytest.raises(ValueError, match=r"OffloadedLamb.*options.lamb.eta"):
        gradkit.OffloadedLamb([{"params": [w], "grads": [g]}], eta=float("nan"))
    assert (w == 1).all() and (g == 1).all()  # nothing written


# -- on a GPU ----------------------------------------------------------------------

@needs_cuda
def test_groups_with_different_learning_rates_are_refused():
    p = params_on("cuda")
    with pytest.raises(ValueError, match=r"learning rates \[0.001, 0.003\].*one \(LAMB's eta\)"):
        gt.OffloadedLamb([{"params": p[:2]}, {"params": p[2:], "lr": 3e-3}])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moments", ["float32", "int8"])
def test_equals_lamb_on_the_gpu_bit_for_bit(dtype, moments):
    a, b = params_on("cuda", dtype), params_on("cuda", dtype)
    off = gt.OffloadedLamb(two_groups(a), lr=1e-2, bucket_mb=0.1, piece_mb=0.01, moments=moments)
    gpu = gt.Lamb(two_groups(b), lr=1e-2, moments=moments, min_8bit_size=0)
    sched = torch.optim.lr_scheduler.StepLR(off, step_size=5, gamma=0.5)
    gpu_sched = torch.optim.lr_scheduler.StepLR(gpu, step_size=5, gamma=0.5)
    assert off.native.num_buckets > 1
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    for step in range(20):
        for p, q, g in zip(a, b, grads_for(step, dtype, "cuda")):
            p.grad, q.grad = g.clone(), g.clone()
        off.step()
        gpu.step()
        sched.step()
        gpu_sched.step()
        for p, q in zip(a, b):
            assert torch.equal(p.view(bits), q.view(bits)), step
    assert off.native.eta == pytest.approx(1e-2 * 0.5 ** 4)
    assert off.native.device_bytes < 4096  # no optimizer state on the GPU


@needs_cuda
@pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                    reason="the hooks need torch >= 2.1")
def test_a_real_backward_with_hooks_equals_the_gpu_step():
    torch.manual_seed(0)
    model = TinyGPT(layers=2, d=64).cuda()
    ref = copy.deepcopy(model)
    off = gt.OffloadedLamb(model.parameters(), lr=3e-3, weight_decay=0.01, bucket_mb=0.05)
    gpu = gt.Lamb(ref.parameters(), lr=3e-3, weight_decay=0.01)
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
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), step
    assert handed_early > 0  # from the second step on, backward's hooks handed buckets


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_moves_between_offloaded_and_gradkit_lamb(dtype):
    def run(opt, params, steps):
        for step in steps:
            for p, g in zip(params, grads_for(step, dtype, "cuda")):
                p.grad = g
            opt.step()

    straight = params_on("cuda", dtype)
    s_opt = gt.OffloadedLamb(two_groups(straight), lr=1e-2)
    run(s_opt, straight, range(10))

    first = params_on("cuda", dtype)
    f_opt = gt.OffloadedLamb(two_groups(first), lr=1e-2)
    run(f_opt, first, range(5))
    state = f_opt.state_dict()
    assert state["state"][0]["exp_avg"].device.type == "cpu"
    assert int(state["state"][0]["step"]) == 5
    # into gradkit.torch.Lamb on the GPU, three steps there, and back
    gpu = gt.Lamb(two_groups(first), lr=1e-2)
    gpu.load_state_dict(state)
    run(gpu, first, range(5, 8))
    back = gt.OffloadedLamb(two_groups(first), lr=1e-2)
    back.load_state_dict(gpu.state_dict())
    assert back.native.step_count == 8
    run(back, first, range(8, 10))
    for p, q in zip(straight, first):
        assert torch.equal(p, q)
