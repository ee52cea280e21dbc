"""AmpStep against PyTorch's sequence GradScaler.unscale_ + clip_grad_norm_ +
GradScaler.step + GradScaler.update with torch.optim.AdamW, with Inf and NaN
injected into the gradients: the same steps skipped, the same scales, the
same weights to rounding. Where the installed torch has no GradScaler for the
device (torch < 2.3 on the CPU), the reference is GradScaler's documented
rule written out here with torch's own clip_grad_norm_ and AdamW."""
import math

import pytest

torch = pytest.importorskip("torch")
import gradkit.torch as gt  # noqa: E402
from tolerances import TORCH_100_STEPS  # noqa: E402

INIT_SCALE, GROWTH_INTERVAL, MAX_NORM = 2.0 ** 10, 3, 0.5
POISON = {4: float("inf"), 5: float("nan"), 11: float("-inf")}  # step -> value put into one gradient


def model_on(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 3)).to(device)


def batches(device, steps):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 12, generator=g).to(device), torch.randn(8, 3, generator=g).to(device))
            for _ in range(steps)]


def torch_grad_scaler(device):
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            return torch.amp.GradScaler(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        except Exception:  # an older torch without a GradScaler for this device
            pass
    if device == "cuda":
        return torch.cuda.amp.GradScaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return None


class DocumentedGradScaler:
    """GradScaler's rule as documented, for a torch without one on this device."""

    def __init__(self):
        self.s, self.tracker, self.found = INIT_SCALE, 0, False

    def scale(self, loss):
        return loss * self.s

    def unscale_(self, opt):
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self.found = any(not torch.isfinite(x).all() for x in grads)
        for x in grads:
            x.mul_(1.0 / self.s)

    def step(self, opt):
        if not self.found:
            opt.step()

    def update(self):
        if self.found:
            self.s, self.tracker = self.s * 0.5, 0
        else:
            self.tracker += 1
            if self.tracker == GROWTH_INTERVAL:
                self.s, self.tracker = self.s * 2.0, 0

    def get_scale(self):
        return self.s


def poison(model, step):
    if step in POISON:
        next(model.parameters()).grad.view(-1)[3] = POISON[step]


def train_with_grad_scaler(device, data, optimizer_class, scaler):
    """GradScaler's sequence (unscale_, clip_grad_norm_, step, update) over `data`, poisoned:
    the model, the scale after each step and the step count of the first parameter."""
    ref = model_on(device)
    ref_opt = optimizer_class(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_scales, ref_steps = [], []
    for s, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ref(x), y)).backward()
        poison(ref, s)
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        scaler.step(ref_opt)
        scaler.update()
        ref_scales.append(float(scaler.get_scale()))
        ref_steps.append(float(ref_opt.state_dict()["state"][0]["step"]) if ref_opt.state else 0.0)
    return ref, ref_scales, ref_steps


def test_fused_step_makes_grad_scalers_decisions(device):
    steps = 20
    data = batches(device, steps)
    ref, ref_scales, ref_steps = train_with_grad_scaler(device, data, torch.optim.AdamW,
                                                        torch_grad_scaler(device) or DocumentedGradScaler())

    ours = model_on(device)
    opt = gt.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.01)
    amp = gt.AmpStep(opt, max_norm=MAX_NORM, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    scales, taken, skipped = [], [], []
    for s, (x, y) in enumerate(data):
        opt.zero_grad()
        amp.scale(torch.nn.functional.mse_loss(ours(x), y)).backward()
        poison(ours, s)
        assert amp.step() is None  # what optimizer.step() returns without a closure
        scales.append(amp.get_scale())
        skipped.append(amp.found_inf)
        taken.append(float(opt.state_dict()["state"][0]["step"]) if opt.state else 0.0)

    assert skipped == [s in POISON for s in range(steps)]
    assert scales == ref_scales
    assert taken == ref_steps
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=TORCH_100_STEPS[0] * 10,
                                   atol=TORCH_100_STEPS[1] * 10)


def test_grad_scaler_drives_a_gradkit_optimizer_as_torchs(device):
    """AmpStep is gradkit's way; GradScaler over a gradkit optimizer works as over torch's."""
    if torch_grad_scaler(device) is None:
        pytest.skip(f"torch {torch.__version__} has no GradScaler for {device}")
    data = batches(device, 20)
    ours, scales, steps = train_with_grad_scaler(device, data, gt.AdamW, torch_grad_scaler(device))
    ref, ref_scales, ref_steps = train_with_grad_scaler(device, data, torch.optim.AdamW, torch_grad_scaler(device))
    assert (scales, steps) == (ref_scales, ref_steps)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=TORCH_100_STEPS[0] * 10,
                                   atol=TORCH_100_STEPS[1] * 10)


def test_grad_norm_is_clip_grad_norms_result(device):
    model = model_on(device)
    opt = gt.AdamW(model.parameters())
    amp = gt.AmpStep(opt, max_norm=1e9, init_scale=256.0)
    x, y = batches(device, 1)[0]
    amp.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    expected = math.sqrt(sum(float((p.grad.double() / 256.0).pow(2).sum()) for p in model.parameters()))
    amp.step()
    assert amp.grad_norm.item() == pytest.approx(expected, rel=1e-6)


def test_state_dict_is_grad_scalers_layout(device):
    opt = gt.AdamW(model_on(device).parameters())
    amp = gt.AmpStep(opt, init_scale=1024.0, growth_interval=5)
    amp.load_state_dict({"scale": 64.0, "_growth_tracker": 2, "growth_factor": 2.0, "backoff_factor": 0.5,
                         "growth_interval": 5})
    sd = amp.state_dict()
    assert sd["scale"] == 64.0 and sd["_growth_tracker"] == 2 and sd["growth_interval"] == 5
    with pytest.raises(ValueError, match="scale"):
        amp.load_state_dict({"_growth_tracker": 1})
    with pytest.raises(ValueError, match="scale"):
        amp.load_state_dict({"scale": -1.0, "_growth_tracker": 0})


def test_bad_arguments(device):
    params = list(model_on(device).parameters())
    with pytest.raises(TypeError, match="gradkit.torch optimizer"):
        gt.AmpStep(torch.optim.AdamW(params))
    with pytest.raises(ValueError, match="max_norm"):
        gt.AmpStep(gt.AdamW(params), max_norm=0.0)
    with pytest.raises(ValueError, match="growth_interval"):
        gt.AmpStep(gt.AdamW(params), growth_interval=0)
