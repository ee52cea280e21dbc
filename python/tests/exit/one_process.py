"""A training script as a new user writes one: everything at module level,
nothing deleted, the last losses and their autograd graphs still alive when
Python exits. Run by test_exit.py, which fails on any "leaked" line (the
reports nanobind prints at exit for gradkit objects still alive then).

1. A 12-layer transformer, gradkit AdamW over flat gradients, bfloat16
   autocast, an LR schedule.
2. A small model under AmpStep with a schedule and torch's step hooks (an
   EMA of the weights in a post-hook, as Lightning-style callbacks do).
3. A bfloat16 model (float32 master weights) with Lamb.
4. A small GPT-shaped model with Muon on its matrices and AdamW on the rest
   (muon_param_groups), an LR schedule (the Muon plans' lr changes each step).
argv[1]: the device (cpu, cuda)."""
import sys

import torch
import torch.nn.functional as F

import gradkit.torch as gt

device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
torch.manual_seed(0)

layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=12), torch.nn.Linear(32, 10)).to(device)
opt = gt.AdamW(model.parameters(), lr=1e-3)
flat = gt.flat_gradients(model, opt)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10)
for step in range(3):
    x, y = torch.randn(4, 8, 32, device=device), torch.randint(0, 10, (4, 8), device=device)
    opt.zero_grad()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    sched.step()

small = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
small_opt = gt.AdamW(small.parameters(), lr=1e-2)
amp = gt.AmpStep(small_opt, max_norm=1.0, init_scale=4.0)
amp_sched = torch.optim.lr_scheduler.StepLR(small_opt, step_size=1, gamma=0.9)
ema = [p.detach().clone() for p in small.parameters()]
if hasattr(small_opt, "register_step_post_hook"):  # torch 2.0 and newer
    small_opt.register_step_post_hook(
        lambda o, args, kwargs: [e.lerp_(p.detach(), 0.1) for e, p in zip(ema, small.parameters())])
for step in range(3):
    small_opt.zero_grad()
    scaled = amp.scale(F.mse_loss(small(torch.randn(8, 16, device=device)), torch.randn(8, 4, device=device)))
    scaled.backward()
    amp.step()
    amp_sched.step()

low = torch.nn.Linear(16, 4).to(device, torch.bfloat16)
low_opt = gt.Lamb(low.parameters(), lr=1e-2, max_grad_norm=1.0)
low_flat = gt.flat_gradients(low, low_opt)
for step in range(3):
    low_opt.zero_grad()
    low_loss = low(torch.randn(8, 16, device=device, dtype=torch.bfloat16)).float().pow(2).mean()
    low_loss.backward()
    low_opt.step()

muon_model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 96), torch.nn.GELU(),
                                 torch.nn.Linear(96, 32), torch.nn.Linear(32, 64)).to(device)
muon_opt = gt.Muon(gt.muon_param_groups(muon_model, lr=3e-3), lr=0.02)
muon_sched = torch.optim.lr_scheduler.CosineAnnealingLR(muon_opt, T_max=3)
for step in range(3):
    muon_opt.zero_grad()
    tokens = torch.randint(0, 64, (4, 8), device=device)
    muon_loss = F.cross_entropy(muon_model(tokens).flatten(0, 1), tokens.flatten())
    muon_loss.backward()
    muon_opt.step()
    muon_sched.step()

print(f"one process on {device}: ok", flush=True)
