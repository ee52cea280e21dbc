"""A training script that compiles its step, as a new user writes one
(everything at module level): a compiled training step with AdamW and a
schedule, and a compiled AmpStep step (torch 2.4+). Run by test_exit.py,
which checks that it exits 0 without nanobind's reports (docs/python.md,
"At exit").
argv[1]: the device (cpu, cuda)."""
import sys

import torch
import torch.nn.functional as F

import gradkit.torch as gt

device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
torch.manual_seed(0)
small = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
from gradkit.torch import _compile

if _compile.AVAILABLE:
    compiled = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    compiled_opt = gt.AdamW(compiled.parameters(), lr=1e-2)
    compiled_sched = torch.optim.lr_scheduler.CosineAnnealingLR(compiled_opt, T_max=10)

    @torch.compile
    def train_step(x, y):
        compiled_loss = F.mse_loss(compiled(x), y)
        compiled_loss.backward()
        compiled_opt.step()
        compiled_opt.zero_grad()
        return compiled_loss

    compiled_amp_opt = gt.AdamW(small.parameters(), lr=1e-2)
    compiled_amp = gt.AmpStep(compiled_amp_opt, max_norm=1.0)
    amp_step = torch.compile(compiled_amp.step)
    for step in range(3):
        last = train_step(torch.randn(8, 16, device=device), torch.randn(8, 4, device=device))
        compiled_sched.step()
        compiled_amp_opt.zero_grad()
        compiled_amp.scale(F.mse_loss(small(torch.randn(8, 16, device=device)), torch.randn(8, 4, device=device))).backward()
        amp_step()

print(f"compiled on {device}: ok", flush=True)
