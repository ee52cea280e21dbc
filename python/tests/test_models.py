"""Real models trained with torch.optim.AdamW and with gradkit.torch.AdamW
from the same initial weights on the same batches: the loss curves agree
(f32), and under autocast with loss scaling the fused AmpStep skips the same
steps as GradScaler. 30 steps on the CPU (CI); GRADKIT_LONG_TESTS=1 trains
300 (the GPU run)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradkit.torch as gt  # noqa: E402
import models  # noqa: E402
from tolerances import (AMP_SAME_SCALES_STEPS, AMP_SMOOTHED, TRAINING_LOSS, TRAINING_SMOOTHED,  # noqa: E402
                        TRAINING_TIGHT_STEPS, TRAINING_WINDOW)

STEPS = 300 if os.environ.get("GRADKIT_LONG_TESTS") else 30


def make(kind, device):
    torch.manual_seed(0)
    if kind == "gpt":
        return models.TinyGPT().to(device), models.text_batches
    if not models.fashion_mnist_available():
        pytest.skip(f"Fashion-MNIST not found in {models.FASHION_MNIST} (Debian: dataset-fashion-mnist)")
    return models.SmallCNN().to(device), models.image_batches


def train(kind, device, optimizer_class, **kwargs):
    model, batches = make(kind, device)
    opt = optimizer_class(model.parameters(), lr=1e-3, weight_decay=0.01, **kwargs)
    losses = []
    for x, y in batches(device, STEPS):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_loss_curves_agree_with_torch_adamw(device, kind):
    ours = train(kind, device, gt.AdamW)
    theirs = train(kind, device, torch.optim.AdamW)
    tight = TRAINING_TIGHT_STEPS
    np.testing.assert_allclose(ours[:tight], theirs[:tight], rtol=TRAINING_LOSS[0], atol=TRAINING_LOSS[1])
    np.testing.assert_allclose(smooth(ours), smooth(theirs), rtol=TRAINING_SMOOTHED)
    assert ours[-5:].mean() < ours[:5].mean()  # it learns


def smooth(losses):
    w = min(TRAINING_WINDOW, len(losses))
    return np.convolve(losses, np.ones(w) / w, mode="valid")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autocast float16 needs CUDA")
@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_amp_skips_the_steps_grad_scaler_skips(kind):
    init_scale = 2.0 ** 24  # high enough that the first steps overflow and back off
    runs = {}
    for name in ("torch", "gradkit"):
        model, batches = make(kind, "cuda")
        if name == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
            scaler = torch.amp.GradScaler("cuda", init_scale=init_scale, growth_interval=50)
        else:
            opt = gt.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            amp = gt.AmpStep(opt, max_norm=1.0, init_scale=init_scale, growth_interval=50)
        losses, scales = [], []
        for x, y in batches("cuda", STEPS):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x, y)
            if name == "torch":
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                amp.scale(loss).backward()
                amp.step()
                scales.append(amp.get_scale())
            losses.append(loss.item())
        runs[name] = (np.array(losses), scales)
    (l_torch, s_torch), (l_ours, s_ours) = runs["torch"], runs["gradkit"]
    same = AMP_SAME_SCALES_STEPS
    assert s_ours[:same] == s_torch[:same]  # the same skipped steps, backoffs and growths
    assert s_ours[0] < init_scale
    backoffs = [sum(b < a for a, b in zip(s, s[1:])) for s in (s_ours, s_torch)]
    assert abs(backoffs[0] - backoffs[1]) <= 2, (backoffs, s_ours, s_torch)
    np.testing.assert_allclose(smooth(l_ours), smooth(l_torch), rtol=AMP_SMOOTHED)
