"""float16/bfloat16 parameters with float32 master weights (ONNX Runtime's
FP16_Optimizer): gradkit's masters against torch.optim.AdamW stepping float32
copies of the parameters on the same (upcast) gradients; the parameters are
their masters rounded to nearest even, bit for bit; the state keeps float32
through state_dict/load_state_dict; and the fused AMP step over a float16
model makes GradScaler's decisions (GradScaler itself cannot unscale float16
gradients, so the reference runs it on the float32 copies)."""
import pytest

torch = pytest.importorskip("torch")
import gradkit.torch as gt  # noqa: E402
from test_torch_amp import (GROWTH_INTERVAL, INIT_SCALE, MAX_NORM, POISON, DocumentedGradScaler,  # noqa: E402
                            torch_grad_scaler)
from tolerances import TORCH_100_STEPS  # noqa: E402

SHAPES = [(17, 5), (33,), (4, 4, 3), (64, 8)]
LOW = [torch.float16, torch.bfloat16]


def low_params(device, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device=device, dtype=dtype)) for s in SHAPES]


def grads_for(step, dtype, device, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * 1e-2 * scale).to(device=device, dtype=dtype) for s in SHAPES]


def two_groups(params, lr):
    return [{"params": params[:2], "weight_decay": 0.05}, {"params": params[2:], "weight_decay": 0.0, "lr": lr * 3}]


def masters_of(params):
    return [torch.nn.Parameter(p.detach().float().clone()) for p in params]


@pytest.mark.parametrize("dtype", LOW)
def test_adamw_masters_follow_torch_on_float32_copies(device, dtype):
    params = low_params(device, dtype)
    ref = masters_of(params)
    opt = gt.AdamW(two_groups(params, 1e-2), lr=1e-2)
    ref_opt = torch.optim.AdamW(two_groups(ref, 1e-2), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=10, gamma=0.5)
    for step in range(60):
        for p, r, g in zip(params, ref, grads_for(step, dtype, device)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    masters = opt.master_params()
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params)
    for p, m, r in zip(params, masters, ref):
        torch.testing.assert_close(m.cpu(), r.detach().cpu(), rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])
        assert torch.equal(p.detach(), m.to(dtype)), "the parameter is not its master rounded"


@pytest.mark.parametrize("make", [gt.Adam, gt.Lamb])
def test_every_optimizer_writes_the_rounded_master(device, make):
    params = low_params(device, torch.bfloat16)
    opt = make(params, lr=1e-2, weight_decay=0.01)
    before = [p.detach().clone() for p in params]
    for step in range(5):
        for p, g in zip(params, grads_for(step, torch.bfloat16, device)):
            p.grad = g
        opt.step()
    for p, m, b in zip(params, opt.master_params(), before):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
        assert not torch.equal(m, b.float()), "the master did not move"


def test_state_dict_keeps_float32_masters_and_moments(device):
    params = low_params(device, torch.float16)
    opt = gt.AdamW(params, lr=1e-2)
    for step in range(4):
        for p, g in zip(params, grads_for(step, torch.float16, device)):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["master_param"].dtype == torch.float32

    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = gt.AdamW(copies, lr=1e-2)
    resumed.load_state_dict(saved)
    for p, q in zip(params, copies):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert resumed.state[q][key].dtype == torch.float32
            assert torch.equal(resumed.state[q][key], opt.state[p][key]), key
    for step in range(4, 8):
        for p, q, g in zip(params, copies, grads_for(step, torch.float16, device)):
            p.grad, q.grad = g, g.clone()
        opt.step()
        resumed.step()
    for p, q in zip(params, copies):
        assert torch.equal(p, q), "the resumed run left the original's path"


def test_torch_state_of_a_float16_model_loads_with_masters_from_the_weights(device):
    params = low_params(device, torch.float16)
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    for step in range(3):
        for q, g in zip((q for grp in torch_opt.param_groups for q in grp["params"]),
                        grads_for(step, torch.float16, device)):
            q.grad = g
        if device == "cpu" and torch.__version__ < "2":
            pytest.skip("torch < 2 has no float16 AdamW on the CPU")
        torch_opt.step()
    ours = gt.AdamW(params, lr=1e-2)
    ours.load_state_dict(torch_opt.state_dict())
    for p in params:
        assert ours.state[p]["master_param"].dtype == torch.float32
        assert torch.equal(ours.state[p]["master_param"], p.detach().float())
        assert ours.state[p]["exp_avg"].dtype == torch.float32


def test_fused_amp_step_on_a_float16_model(device):
    steps = 16
    params = low_params(device, torch.float16)
    ref = masters_of(params)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    scaler = torch_grad_scaler(device) or DocumentedGradScaler()
    opt = gt.AdamW(params, lr=1e-2, weight_decay=0.01)
    amp = gt.AmpStep(opt, max_norm=MAX_NORM, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    for step in range(steps):
        scaler.scale(torch.ones((), device=device))  # GradScaler makes its scale in scale(), as a backward would
        scale = amp.get_scale()
        assert scale == float(scaler.get_scale())
        grads = grads_for(step, torch.float16, device, scale)  # what a scaled backward in float16 gives
        if step in POISON:
            grads[0].view(-1)[3] = POISON[step]
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g, g.float()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)
        scaler.step(ref_opt)
        scaler.update()
        amp.step()
        assert amp.found_inf == (step in POISON)
    for p, m, r in zip(params, opt.master_params(), ref):
        torch.testing.assert_close(m.cpu(), r.detach().cpu(), rtol=TORCH_100_STEPS[0] * 10,
                                   atol=TORCH_100_STEPS[1] * 10)
        assert torch.equal(p.detach(), m.to(torch.float16))


def test_mixed_dtypes_are_refused(device):
    params = low_params(device, torch.float16)
    params[1] = torch.nn.Parameter(params[1].detach().float())
    with pytest.raises(TypeError, match="float16"):  # at construction, not at the first step
        gt.AdamW(params)
