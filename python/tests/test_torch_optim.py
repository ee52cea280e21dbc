"""gradkit.torch's optimizers against torch.optim on the same parameters and
gradients, and LAMB against a float64 reference."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradkit.torch as gt  # noqa: E402
from tolerances import REFERENCE_STEP, TORCH_100_STEPS  # noqa: E402

SHAPES = [(64, 33), (33,), (7, 5, 3), (1,), (300,)]


def make_params(device, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in shapes]


def gradient_sequence(steps, shapes=SHAPES, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) * 0.1 for s in shapes] for _ in range(steps)]


def groups_of(params):
    return [{"params": params[:2], "lr": 2e-3, "weight_decay": 0.1},
            {"params": params[2:], "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def assert_close(a_params, b_params, tol=TORCH_100_STEPS):
    for a, b in zip(a_params, b_params):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=tol[0], atol=tol[1], equal_nan=True)


def run(opt_cls, params, grads, scheduler=True, skip=None, **kwargs):
    opt = opt_cls(groups_of(params), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7) if scheduler else None
    for s, step_grads in enumerate(grads):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            p.grad = None if skip and skip(s, i) else g.to(p.device)
        opt.step()
        if sched:
            sched.step()
    return opt


@pytest.mark.parametrize("names", [("AdamW", {}), ("Adam", {}), ("AdamW", {"amsgrad": True}),
                                   ("Adam", {"maximize": True, "eps": 1e-6})], ids=lambda n: n[0] + str(n[1]))
def test_matches_torch_optim_over_100_steps(device, names):
    name, kwargs = names
    grads = gradient_sequence(100)
    ours, theirs = make_params(device), make_params(device)
    run(getattr(gt, name), ours, grads, **kwargs)
    run(getattr(torch.optim, name), theirs, grads, **kwargs)
    assert_close(ours, theirs)


def test_parameters_without_gradients_are_skipped_as_torch_skips_them(device):
    grads = gradient_sequence(30)
    skip = lambda step, i: (i == 1 and step % 3 == 0) or (i == 4 and step < 10)  # noqa: E731
    ours, theirs = make_params(device), make_params(device)
    a = run(gt.AdamW, ours, grads, skip=skip)
    b = run(torch.optim.AdamW, theirs, grads, skip=skip)
    assert_close(ours, theirs)
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert [float(sa[i]["step"]) for i in range(5)] == [float(sb[i]["step"]) for i in range(5)] == [30, 20, 30, 30, 20]


def small_model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5)).to(device)


def train(model, opt, steps, device, set_to_none=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g).to(device)
        y = torch.randn(16, 5, generator=g).to(device)
        opt.zero_grad(set_to_none=set_to_none)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("set_to_none", [True, False])
def test_real_backward_with_either_zero_grad(device, set_to_none):
    a, b = small_model(device), small_model(device)
    la = train(a, gt.AdamW(a.parameters(), lr=1e-2), 40, device, set_to_none)
    lb = train(b, torch.optim.AdamW(b.parameters(), lr=1e-2), 40, device, set_to_none)
    np.testing.assert_allclose(la, lb, rtol=TORCH_100_STEPS[0] * 10)
    assert_close(a.parameters(), b.parameters())


@pytest.mark.parametrize("direction", ["torch_to_gradkit", "gradkit_to_torch"])
def test_state_dict_moves_between_torch_and_gradkit(device, direction):
    first, then = (torch.optim.AdamW, gt.AdamW) if direction == "torch_to_gradkit" else (gt.AdamW, torch.optim.AdamW)
    ref = small_model(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    ref_losses = train(ref, ref_opt, 20, device, seed=5)

    model = small_model(device)
    opt = first(model.parameters(), lr=1e-2, weight_decay=0.05)
    losses = train(model, opt, 10, device, seed=5)
    saved = opt.state_dict()
    moved = then(model.parameters(), lr=1.0, weight_decay=0.0)  # replaced by the loaded groups
    moved.load_state_dict(saved)
    g = torch.Generator().manual_seed(5)
    for _ in range(10):  # the same batches the reference saw
        torch.randn(16, 20, generator=g), torch.randn(16, 5, generator=g)
    losses += train_from(model, moved, 10, device, g)
    np.testing.assert_allclose(losses, ref_losses, rtol=TORCH_100_STEPS[0] * 10)
    assert_close(model.parameters(), ref.parameters())
    back = moved.state_dict()
    assert float(back["state"][0]["step"]) == 20
    assert set(back["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}


def train_from(model, opt, steps, device, g):
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g).to(device)
        y = torch.randn(16, 5, generator=g).to(device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_closure_is_called_and_its_loss_returned(device):
    model = small_model(device)
    opt = gt.Adam(model.parameters())
    x, y = torch.randn(4, 20, device=device), torch.randn(4, 5, device=device)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert loss is not None and loss.item() > 0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name, kwargs", [("AdamW", {}), ("Lamb", {"max_grad_norm": 0.05})], ids=["AdamW", "Lamb"])
def test_a_deep_copy_goes_on_where_the_original_is(device, name, kwargs):
    """copy.deepcopy (and pickle) keep the step counts (on the device until then) and the
    settings outside param_groups; the copy steps the copied parameters alike."""
    import copy
    grads = gradient_sequence(6)
    params = make_params(device)
    opt = run(getattr(gt, name), params, grads[:3], scheduler=False, **kwargs)
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(params, twin_params))
    for optimizer, ps in ((opt, params), (twin, twin_params)):
        for step_grads in grads[3:]:
            for p, g in zip(ps, step_grads):
                p.grad = g.to(device)
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
    assert twin.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 6
    assert getattr(twin, "max_grad_norm", None) == kwargs.get("max_grad_norm")


def test_flat_gradients_step_like_torch_without_set_to_none(device):
    a, b = small_model(device), small_model(device)
    opt_a = gt.AdamW(a.parameters(), lr=1e-2)
    flat = gt.flat_gradients(a, opt_a)
    la = train(a, opt_a, 30, device)
    assert flat.attached()
    lb = train(b, torch.optim.AdamW(b.parameters(), lr=1e-2), 30, device, set_to_none=False)
    np.testing.assert_allclose(la, lb, rtol=TORCH_100_STEPS[0] * 10)
    assert_close(a.parameters(), b.parameters())
    a.zero_grad(set_to_none=True)  # detaches the views: the optimizer must notice
    la2 = train(a, opt_a, 3, device, seed=9)
    lb2 = train(b, torch.optim.AdamW(b.parameters(), lr=1e-2), 3, device, seed=9, set_to_none=False)
    assert len(la2) == len(lb2) == 3 and not flat.attached()


def lamb_reference(w, g, m, v, t, lr, b1, b2, eps, wd):
    """ONNX Runtime's LAMB (docs/ops.md, lamb_step) in float64, no clipping."""
    w, g, m, v = (x.astype(np.float64) for x in (w, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    d = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * w
    wn, dn = np.linalg.norm(w), np.linalg.norm(d)
    r = wn / dn if wn > 0 and dn > 0 else 1.0
    return w - lr * r * d, m, v


def test_lamb_matches_the_float64_reference(device):
    params = make_params(device)
    grads = gradient_sequence(3)
    w = [p.detach().cpu().numpy().astype(np.float64) for p in params]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    opt = gt.Lamb(params, lr=1e-2, weight_decay=0.01)
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            p.grad = g.to(device)
            w[i], m[i], v[i] = lamb_reference(w[i], g.numpy(), m[i], v[i], t, np.float32(1e-2), np.float32(0.9),
                                              np.float32(0.999), np.float32(1e-6), np.float32(0.01))
        opt.step()
    rtol, atol = REFERENCE_STEP[np.float32]
    for p, ref in zip(params, w):
        np.testing.assert_allclose(p.detach().cpu().numpy(), ref, rtol=rtol * 10, atol=atol * 10)
    assert float(opt.state_dict()["state"][0]["step"]) == 3


def test_lamb_clips_by_the_global_norm(device):
    a, b = make_params(device), make_params(device)
    grads = gradient_sequence(1)
    big = [g * 100 for g in grads[0]]
    opt_a = gt.Lamb(a, lr=1e-2, max_grad_norm=1.0)
    opt_b = gt.Lamb(b, lr=1e-2)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in big))
    for p, g in zip(a, big):
        p.grad = g.to(device)
    for p, g in zip(b, big):
        p.grad = (g.double() / (norm / 1.0)).float().to(device)  # pre-clipped by hand
    opt_a.step()
    opt_b.step()
    assert_close(a, b, tol=(1e-4, 1e-6))


def test_bad_arguments_are_rejected_with_clear_errors(device):
    with pytest.raises(ValueError, match="betas"):
        gt.AdamW(make_params(device), betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr"):
        gt.Adam(make_params(device), lr=-1)
    p = make_params(device)
    opt = gt.AdamW(p)
    before = p[0].detach().clone()
    for q in p:
        q.grad = torch.ones_like(q)
    p[0].grad = torch.ones(33, 64, device=device).t()  # a non-contiguous gradient
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step()
    assert torch.equal(before, p[0].detach())


def test_inf_gradient_propagates_like_torch_without_amp(device):
    a, b = make_params(device), make_params(device)
    grads = gradient_sequence(1)
    grads[0][2][0, 0, 0] = float("nan")
    run(gt.AdamW, a, grads, scheduler=False)
    run(torch.optim.AdamW, b, grads, scheduler=False)
    assert torch.isnan(a[2]).sum() == torch.isnan(b[2]).sum() == 1
    assert_close(a, b)
