"""The mixed-precision step fused: one call for GradScaler.unscale_,
clip_grad_norm_, GradScaler.step and GradScaler.update.

gradkit's gradient check reads the gradients once: it finds Inf/NaN and the
norm of the unscaled gradients, and folds the loss scale and the clip
coefficient into one divisor on the device; the optimizer's update divides
by it (no unscaling pass, no clipping pass) or, on an overflow, writes
nothing and leaves the step count alone; the loss scaler then makes
GradScaler's decision (back off on an overflow, grow after growth_interval
clean steps) on the device. No host synchronization anywhere.
"""
import math

import torch

import gradkit
from gradkit.torch import _compile
from gradkit.torch._device import device_name
from gradkit.torch._gradient_check import GradientCheck


class AmpStep:
    """For a gradkit.torch optimizer over float32 parameters trained under
    torch.autocast::

        amp = gradkit.torch.AmpStep(optimizer, max_norm=1.0)
        for x, y in data:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            amp.scale(loss).backward()
            amp.step()                  # check, unscale + clip, step or skip, scale update
            optimizer.zero_grad()

    The parameters may be float32 (the autocast setup) or float16/bfloat16:
    the optimizer then keeps float32 master weights and writes the rounded
    parameters in its update pass (ONNX Runtime's FP16_Optimizer; torch's
    GradScaler refuses to unscale float16 gradients).

    The arguments are GradScaler's (init_scale, growth_factor, backoff_factor,
    growth_interval, enabled) and clip_grad_norm_'s (max_norm, norm_type: 2.0
    or inf); `hysteresis` > 1 is DeepSpeed's (back off only after that many
    overflows). enabled=False keeps the scale at 1 but still skips a step
    whose gradients hold an Inf or NaN.
    """

    def __init__(self, optimizer, *, max_norm=None, norm_type=2.0, init_scale=2.0 ** 16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, hysteresis=1, enabled=True):
        if not hasattr(optimizer, "_step_with"):
            raise TypeError(f"optimizer is a {type(optimizer).__name__}, expected a gradkit.torch optimizer "
                            "(Adam, AdamW or Lamb)")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm is {max_norm}, expected a value > 0 (or None: no clipping)")
        if norm_type not in (2, 2.0, math.inf, float("inf"), "inf"):
            raise ValueError(f"norm_type is {norm_type}, expected 2.0 or inf")
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.norm = gradkit.NormType.l2 if norm_type in (2, 2.0) else gradkit.NormType.infinity
        device = optimizer._get_layout().device
        options = gradkit.LossScalerOptions(
            mode=gradkit.LossScaling.dynamic if enabled else gradkit.LossScaling.none, initial_scale=init_scale,
            growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval,
            hysteresis=hysteresis)
        self._scaler = gradkit.LossScaler(device_name(device), options)
        self._scale = torch.from_dlpack(self._scaler.scale_device).view(())  # 0-dim, as GradScaler's
        self._found_inf = torch.zeros(1, dtype=torch.bool, device=device)
        # What gradkit writes and reads: the same byte, as uint8 (PyTorch before 2.0 has no bool in DLPack).
        self._divisor = torch.ones(1, dtype=torch.float32, device=device)
        self._norm = torch.zeros(1, dtype=torch.float32, device=device)
        # The per-step scalars as gradkit takes them, converted once.
        self._flag = gradkit.DeviceScalar(self._found_inf.view(torch.uint8))
        self._divisor_scalar = gradkit.DeviceScalar(self._divisor)
        self._norm_scalar = gradkit.DeviceScalar(self._norm)
        # From the scaler's own array, not from self._scale: gradkit then holds no torch tensor (one
        # whose last owner is C++ when Python exits is never freed, nor what its memory belongs to).
        self._scale_scalar = gradkit.DeviceScalar(self._scaler.scale_device)
        self._check = GradientCheck(optimizer, norm=self.norm, max_norm=self.max_norm or 0.0)
        self._stream = None  # the stream of the step in progress; None while nothing was launched
        self._graph_handle = _compile.register(self)  # for gradkit::step_ (torch.compile)

    def scale(self, outputs):
        """outputs * S, S being the current scale on the device; `outputs` is a tensor or
        (as GradScaler.scale takes them) a list or tuple of tensors, nested or not."""
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs is a {type(outputs).__name__}, expected a tensor or a list or tuple of tensors")

    def step(self, closure=None):
        """Check, update or skip, and the scaler's decision, enqueued on the current stream,
        through optimizer.step(closure): its step pre- and post-hooks run, LR schedulers
        count the step, and wrappers of optimizer.step see it, as under GradScaler.step;
        unlike GradScaler, on every call, since whether the step is skipped is known on the
        device only. Returns what optimizer.step returns (closure()'s loss, or None)."""
        opt = self.optimizer
        if _compile.is_compiling():
            # Under torch.compile the optimizer's step() finds this AmpStep here, and its
            # graph's gradkit::step_ runs _step_in_graph (gradkit.torch._compile).
            _compile.fused_callers.append(self)
            try:
                return opt.step() if closure is None else opt.step(closure)
            finally:
                _compile.fused_callers.pop()
        self._stream = None
        opt._fused_step = self._launch_fused
        try:
            loss = opt.step() if closure is None else opt.step(closure)
        finally:
            opt._fused_step = None
        self._update_scale()
        return loss

    def graph_outputs(self):
        """What the fused step writes for the caller besides the parameters: the loss scale,
        found_inf and the norm (declared mutated by gradkit::step_)."""
        return [self._scale, self._found_inf, self._norm]

    def _fused_arguments(self):
        """The optimizer's _step_with arguments that make it the fused step: the flag, the
        divisor and the check, which also notes the stream of the step."""
        def check(stream):
            self._check.check(stream, found_inf=self._flag, grad_divisor=self._divisor_scalar,
                              global_norm=self._norm_scalar, loss_scale_device=self._scale_scalar)
            self._stream = stream

        return self._flag, self._divisor_scalar, check

    def _update_scale(self):
        """The scaler's decision, after a step that launched something."""
        if self._stream is not None:  # some parameter had a gradient
            self._scaler.update(self._flag, stream=self._stream)

    def _launch_fused(self):
        """What optimizer.step() does when called from step(): the check folded into the update."""
        self.optimizer._step_with(*self._fused_arguments())

    def _release_native(self):
        """Drops every gradkit object this AmpStep holds (at exit: gradkit.torch._compile)."""
        self._scaler = self._check = None
        self._flag = self._divisor_scalar = self._norm_scalar = self._scale_scalar = None

    def _step_in_graph(self, params, grads):
        """gradkit::step_'s implementation for a compiled AmpStep.step(): the fused step and
        the scaler's decision in one operator (after the optimizer's post-hooks run, as in
        eager, only if they do not read the scale)."""
        self._stream = None
        self.optimizer._step_in_graph(params, grads, fused=self._fused_arguments())
        self._update_scale()

    # -- what GradScaler offers ------------------------------------------------

    def get_scale(self):
        """The current scale (synchronous)."""
        return self._scaler.state()[0]

    @property
    def found_inf(self):
        """Whether the last step found an Inf or NaN and was skipped (synchronous)."""
        return bool(self._found_inf.item())

    @property
    def found_inf_device(self):
        """The same as a one-element bool tensor on the device, read without a synchronization
        (a step post-hook that must not act on a skipped step: torch.where on it)."""
        return self._found_inf

    @property
    def grad_norm(self):
        """The last step's norm of the unscaled gradients, a float32 tensor on the device
        (what clip_grad_norm_ returns; Inf or NaN on an overflow)."""
        return self._norm

    def state_dict(self):
        """GradScaler's layout."""
        scale, tracker, _ = self._scaler.state()
        o = self._scaler.options
        return {"scale": scale, "growth_factor": o.growth_factor, "backoff_factor": o.backoff_factor,
                "growth_interval": o.growth_interval, "_growth_tracker": tracker}

    def load_state_dict(self, state_dict):
        """From this class's or GradScaler's state_dict (the scale and the growth tracker)."""
        for key in ("scale", "_growth_tracker"):
            if key not in state_dict:
                raise ValueError(f"state_dict has no '{key}'; expected GradScaler's layout")
        self._scaler.set_state(float(state_dict["scale"]), int(state_dict["_growth_tracker"]))
