"""AmpStep.step() goes through optimizer.step(), as GradScaler.step does: LR
schedulers count its steps (no "lr_scheduler.step() before
optimizer.step()" warning), torch's step pre- and post-hooks run once per
call (skipped steps included: whether a step is skipped is known on the
device only), wrappers of optimizer.step and the profiler see it, and
step(closure) does the same and returns the closure's loss."""
import warnings

import pytest

torch = pytest.importorskip("torch")
import gradkit.torch as gt  # noqa: E402

STEPS = 3
has_step_hooks = pytest.mark.skipif(not hasattr(torch.optim.Optimizer, "register_step_pre_hook"),
                                    reason=f"torch {torch.__version__} has no optimizer step hooks (2.0 and newer)")

SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1)),
}


def model_on(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(device)


def batch(device, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 12, generator=g).to(device), torch.randn(8, 3, generator=g).to(device)


def loss_of(model, device, step):
    x, y = batch(device, step)
    return torch.nn.functional.mse_loss(model(x), y)


def amp_for(model):
    opt = gt.AdamW(model.parameters(), lr=1e-2)
    return opt, gt.AmpStep(opt, max_norm=1.0, init_scale=4.0)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_schedulers_see_the_step(device, name):
    model = model_on(device)
    opt, amp = amp_for(model)
    sched = SCHEDULERS[name](opt)
    reference = torch.optim.AdamW(model_on(device).parameters(), lr=1e-2)
    ref_sched = SCHEDULERS[name](reference)
    lrs, ref_lrs = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad()
            amp.scale(loss_of(model, device, step)).backward()
            amp.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            reference.step()  # no gradients: only the schedule's bookkeeping
            ref_sched.step()
            ref_lrs.append(reference.param_groups[0]["lr"])
    messages = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    assert messages == []
    assert lrs == ref_lrs
    assert not amp.found_inf


@has_step_hooks
def test_step_hooks_run_once_per_call_skipped_steps_included(device):
    model = model_on(device)
    opt, amp = amp_for(model)
    weight = next(model.parameters())
    seen = []

    def pre(optimizer, args, kwargs):
        assert optimizer is opt
        seen.append(("pre", weight.detach().clone()))

    def post(optimizer, args, kwargs):
        seen.append(("post", weight.detach().clone(), bool(amp.found_inf_device.item())))

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    poisoned = 1
    for step in range(STEPS):
        opt.zero_grad()
        amp.scale(loss_of(model, device, step)).backward()
        if step == poisoned:
            weight.grad.view(-1)[0] = float("inf")
        amp.step()
    for h in handles:
        h.remove()
    assert [s[0] for s in seen] == ["pre", "post"] * STEPS
    for step in range(STEPS):
        (_, before), (_, after, skipped) = seen[2 * step], seen[2 * step + 1]
        assert skipped == (step == poisoned)
        # The pre-hook runs before the update, the post-hook after it; a skipped step writes nothing.
        assert torch.equal(before, after) == (step == poisoned)


@has_step_hooks
def test_global_step_hooks_run_too(device):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    model = model_on(device)
    opt, amp = amp_for(model)
    calls = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("pre", o))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("post", o)))]
    try:
        amp.scale(loss_of(model, device, 0)).backward()
        amp.step()
    finally:
        for h in handles:
            h.remove()
    assert calls == [("pre", opt), ("post", opt)]


def test_wrappers_of_optimizer_step_see_it(device):
    """What swa_utils-style code, Lightning and the profiler rely on: a replaced opt.step is called."""
    model = model_on(device)
    opt, amp = amp_for(model)
    calls = []
    inner = opt.step

    def wrapper(*args, **kwargs):
        calls.append(args)
        return inner(*args, **kwargs)

    opt.step = wrapper
    amp.scale(loss_of(model, device, 0)).backward()
    amp.step()
    assert calls == [()]
    with torch.autograd.profiler.profile() as prof:
        amp.step()
    assert any(e.name.startswith("Optimizer.step#AdamW.step") for e in prof.function_events)


def test_step_with_a_closure(device):
    plain, closed = model_on(device), model_on(device)
    opt, amp = amp_for(plain)
    copt, camp = amp_for(closed)
    calls = []
    if hasattr(copt, "register_step_pre_hook"):
        copt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", args)))
        copt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", args)))
    for step in range(STEPS):
        opt.zero_grad()
        amp.scale(loss_of(plain, device, step)).backward()
        amp.step()

        losses = []

        def closure():
            copt.zero_grad()
            losses.append(loss_of(closed, device, step))
            camp.scale(losses[-1]).backward()
            return losses[-1]

        assert camp.step(closure) is losses[0] and len(losses) == 1
    for a, b in zip(plain.parameters(), closed.parameters()):
        assert torch.equal(a, b)
    if hasattr(copt, "register_step_pre_hook"):
        assert [c[0] for c in calls] == ["pre", "post"] * STEPS


def test_scale_takes_what_grad_scaler_scale_takes(device):
    model = model_on(device)
    _, amp = amp_for(model)
    a, b, c = (loss_of(model, device, s) for s in range(3))
    out = amp.scale([a, (b, c)])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    for got, want in zip([out[0], *out[1]], [a, b, c]):
        assert torch.equal(got, want * 4.0)
    with pytest.raises(TypeError, match="outputs is a dict"):
        amp.scale({"loss": a})
