"""Every tolerance the Python tests use, in one place, per dtype and comparison.

- against the float64 reference: the kernels compute in float32, so a few
  float32 roundings per step; the bound grows with the steps taken.
- against torch.optim: both compute in float32 with the same order of
  operations (docs/ops.md), differing only where a compiler fuses a
  multiply-add; a trained model's curves drift by rounding only.
"""
import numpy as np

# (rtol, atol) of one optimizer step's weights against the float64 reference.
REFERENCE_STEP = {np.float32: (2e-6, 1e-7), np.float64: (1e-12, 1e-14)}
# weights after 100 steps, gradkit against torch.optim on the same gradients (f32).
TORCH_100_STEPS = (1e-5, 1e-6)
# per-step loss of a model trained the same way with gradkit and torch (f32).
TRAINING_LOSS = (2e-3, 1e-5)
# norms from gradkit's check against a float64 reference (f32 result of an f64 sum).
NORM = (1e-6, 0.0)
