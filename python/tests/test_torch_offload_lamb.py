"""gradkit.torch.OffloadedLamb: LAMB with the state on the host, the step on the CPU.

On a GPU: bit for bit the weights of gradkit.torch.Lamb stepping on the CPU
(the same CPU LAMB; an offloaded piece holds whole tensors, so each tensor's
norms are summed as a whole-model step sums them); against gradkit.torch.Lamb
on the GPU bit for bit with int8 moments, and to rounding with float32 ones
(the CPU sums the norms' chunks in f64, CUDA in f32: docs/ops.md); through a
real backward with the hooks handing buckets (torch >= 2.1), and through
state_dict both ways. On the CPU: the argument checks that need no GPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from test_torch_offload import (grads_for, needs_cuda, needs_hooks, params_on, run_steps,  # noqa: E402
                                train_side_by_side)


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


def same_bits(p, q):
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[p.dtype]
    return torch.equal(p.detach().cpu().view(bits), q.detach().cpu().view(bits))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moments", ["float32", "int8", "int4"])
def test_equals_lamb_on_the_cpu_bit_for_bit_and_on_the_gpu(dtype, moments):
    a, b = params_on("cuda", dtype), params_on("cuda", dtype)
    c = [torch.nn.Parameter(p.detach().cpu().clone()) for p in params_on("cuda", dtype)]
    off = gt.OffloadedLamb(two_groups(a), lr=1e-2, bucket_mb=0.1, piece_mb=0.01, moments=moments)
    gpu = gt.Lamb(two_groups(b), lr=1e-2, moments=moments, min_8bit_size=0, min_4bit_size=0)
    cpu = gt.Lamb(two_groups(c), lr=1e-2, moments=moments, min_8bit_size=0, min_4bit_size=0)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (off, gpu, cpu)]
    assert off.native.num_buckets > 1
    for step in range(20):
        for p, q, r, g in zip(a, b, c, grads_for(step, dtype, "cuda")):
            p.grad, q.grad, r.grad = g.clone(), g.clone(), g.cpu()
        for opt in (off, gpu, cpu):
            opt.step()
        for s in scheds:
            s.step()
        for p, q, r in zip(a, b, c):
            assert same_bits(p, r), step
            if moments != "float32":  # 8- and 4-bit: the GPU sums its blocks' norms as the CPU does
                assert same_bits(p, q), step
    for p, q in zip(a, b):  # float32 moments: the GPU's norms round otherwise
        torch.testing.assert_close(p, q, rtol={torch.float32: 1e-5, torch.bfloat16: 2 ** -7,
                                              torch.float16: 2 ** -10}[dtype], atol=1e-6)
    assert off.native.eta == pytest.approx(1e-2 * 0.5 ** 3)  # the lr of the last step (the scheduler ran on)
    assert off.native.device_bytes < 4096  # no optimizer state on the GPU


@needs_cuda
@needs_hooks
def test_a_real_backward_with_hooks_equals_the_gpu_step():
    # int8 moments: the GPU's LAMB gives the CPU's bits (float moments: to rounding)
    train_side_by_side(
        lambda p: gt.OffloadedLamb(p, lr=3e-3, weight_decay=0.01, bucket_mb=0.05, moments="int8"),
        lambda p: gt.Lamb(p, lr=3e-3, weight_decay=0.01, moments="int8", min_8bit_size=0))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_moves_between_offloaded_and_gradkit_lamb(dtype):
    def run(opt, params, steps):
        run_steps(opt, params, steps, dtype)

    # int8 moments: three steps on the GPU give the offloaded steps' bits
    straight = params_on("cuda", dtype)
    s_opt = gt.OffloadedLamb(two_groups(straight), lr=1e-2, moments="int8")
    run(s_opt, straight, range(10))

    first = params_on("cuda", dtype)
    f_opt = gt.OffloadedLamb(two_groups(first), lr=1e-2, moments="int8")
    run(f_opt, first, range(5))
    state = f_opt.state_dict()
    assert state["state"][0]["exp_avg"].device.type == "cpu"
    assert int(state["state"][0]["step"]) == 5
    # into gradkit.torch.Lamb on the GPU, three steps there, and back
    gpu = gt.Lamb(two_groups(first), lr=1e-2, moments="int8", min_8bit_size=0)
    gpu.load_state_dict(state)
    run(gpu, first, range(5, 8))
    back = gt.OffloadedLamb(two_groups(first), lr=1e-2, moments="int8")
    back.load_state_dict(gpu.state_dict())
    assert back.native.step_count == 8
    run(back, first, range(8, 10))
    for p, q in zip(straight, first):
        assert torch.equal(p, q)

    # float32 moments: the state goes to gradkit.torch.Lamb and comes back as it was
    f32 = gt.OffloadedLamb(two_groups(first), lr=1e-2)
    run(f32, first, range(3))
    saved = f32.state_dict()
    gpu = gt.Lamb(two_groups(first), lr=1e-2)
    gpu.load_state_dict(saved)
    again = gt.OffloadedLamb(two_groups(first), lr=1e-2)
    again.load_state_dict(gpu.state_dict())
    for key, s in again.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[name], saved["state"][key][name]), (key, name)
        assert int(s["step"]) == 3
