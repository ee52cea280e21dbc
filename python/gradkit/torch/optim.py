"""Adam, AdamW and LAMB as torch.optim.Optimizer subclasses over gradkit's plans.

Every number is computed by gradkit (AdamPlan, LambPlan, GradientCheckPlan);
what they share (cohorts, the layout, re-pointing, state dicts) is
gradkit.torch._planned's _PlannedOptimizer; that module's docstring says
when plans are made and re-pointed.
"""
import torch

import gradkit
from gradkit.torch._dtensor import RankRows, local
from gradkit.torch._gradient_check import GradientCheck
from gradkit.torch._param_groups import adam_hyperparameters, lamb_hyperparameters
from gradkit.torch._planned import _check_hyperparameters, _PlannedOptimizer
from gradkit.torch._state_forms import StateForm


class Adam(_PlannedOptimizer):
    """torch.optim.Adam's update (L2 weight decay added to the gradient) in gradkit's
    one-pass kernel. Same arguments; `foreach`, `fused` and `capturable` are accepted
    and ignored (gradkit's step is always one launch per cohort). Two of gradkit's own:
    moments="float32" (torch's), "bfloat16", "int8" (8-bit blockwise, about 2.06
    bytes of state per parameter; parameters of fewer than min_8bit_size elements
    keep float32 moments) or "int4" (4-bit blockwise, about 1.06 bytes; likewise
    min_4bit_size), and for bfloat16 parameters
    master="float32" (4 bytes per parameter) or "remainder" (2 bytes, the same
    master bit for bit); gradkit.torch._state_forms says what each stores."""

    _copied_attributes = ("_form",)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, foreach=None, fused=None, capturable=False, differentiable=False,
                 decoupled_weight_decay=False, moments="float32", master="float32", min_8bit_size=4096,
                 min_4bit_size=4096):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if differentiable:
            raise ValueError("differentiable=True is not supported: gradkit's step is not part of the autograd graph")
        self._form = StateForm(moments, master, min_8bit_size, min_4bit_size)
        # torch.optim.Adam's group keys, so that state dicts move both ways with their meaning.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=bool(decoupled_weight_decay))
        super().__init__(params, defaults)
        # A state form the parameters cannot take is refused now rather than at the first step.
        self._form.check([p for g in self.param_groups for p in g["params"]], amsgrad)

    def _moment_names(self, group):
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _loaded_group(self, group):
        """L2 weight decay unless the loaded group says otherwise, as torch.optim.Adam loads."""
        group.setdefault("decoupled_weight_decay", False)

    def _hyperparameters(self, g):
        """A group's hyperparameters; its "decoupled_weight_decay" picks AdamW's weight decay
        (torch.optim.Adam's key: a torch.optim.AdamW state dict loaded here stays AdamW)."""
        decay = gradkit.WeightDecay.decoupled if g.get("decoupled_weight_decay") else gradkit.WeightDecay.l2
        return adam_hyperparameters(g, decay)

    def _make_plan(self, indices, grads):
        weights, g, groups, copy, remainder = self._plan_lists(indices, grads)
        amsgrad = any(grp.get("amsgrad", False) for grp in self.param_groups)  # groups without the key: none
        vmax = []
        if amsgrad:
            params = self._layout.params
            for i in indices:
                s = self.state[params[i]]
                if "max_exp_avg_sq" not in s:
                    s["max_exp_avg_sq"] = torch.zeros_like(params[i], dtype=self._form.moment_dtype(params[i]),
                                                           memory_format=torch.contiguous_format)
                vmax.append(local(s["max_exp_avg_sq"]))
        return gradkit.AdamPlan(weights, g, self._state_list(indices, "exp_avg"),
                                self._state_list(indices, "exp_avg_sq"),
                                [self._hyperparameters(grp) for grp in self.param_groups], groups,
                                max_exp_avg_sq=vmax, model_copy=copy, weight_remainder=remainder,
                                hold_grads=False, **self._absmax_lists(indices))

    def _cohort_key(self, index):
        """Quantized and float32 moments (min_8bit_size, min_4bit_size) never share a plan."""
        return self._form.quantized(self._layout.params[index])

    def _launch_all(self, cohorts, stream, found_inf, grad_divisor):
        lr = self._lr_tensor()
        for c in cohorts:
            gradkit.advance_step(c.counter_scalar, skip=found_inf, stream=stream)
            c.plan.step(step_device=c.counter_scalar, lr_device=lr, grad_scale_device=grad_divisor,
                        found_inf=found_inf, stream=stream)


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2) in gradkit's one-pass kernel."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, fused=None, capturable=False, differentiable=False,
                 moments="float32", master="float32", min_8bit_size=4096, min_4bit_size=4096):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         fused=fused, capturable=capturable, differentiable=differentiable,
                         decoupled_weight_decay=True, moments=moments, master=master, min_8bit_size=min_8bit_size,
                         min_4bit_size=min_4bit_size)

    def _loaded_group(self, group):
        """Decoupled weight decay whatever the loaded group says, as torch.optim.AdamW loads."""
        group["decoupled_weight_decay"] = True


class Lamb(_PlannedOptimizer):
    """LAMB with ONNX Runtime's semantics (docs/ops.md, lamb_step): Adam's moments,
    a per-tensor trust ratio |w| / |update| clamped to [min_trust, max_trust], and
    weight decay inside the update. `max_grad_norm` > 0 clips by the global norm of
    all gradients (computed by gradkit's gradient check) as ONNX Runtime does.
    moments="int8", "int4" (or "bfloat16") store the moments as Adam's do
    (min_8bit_size, min_4bit_size likewise). For bfloat16 parameters
    master="float32" (4 bytes per parameter) or "remainder" (2 bytes, the same
    master bit for bit; float moments only: "float32" or "bfloat16")."""

    _counter_offset = 1  # LambPlan's counter holds the next t
    _copied_attributes = ("max_grad_norm", "_form")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, *,
                 min_trust=float("-inf"), max_trust=float("inf"), max_grad_norm=None, bias_correction=True,
                 moments="float32", master="float32", min_8bit_size=4096, min_4bit_size=4096):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm is {max_grad_norm}, expected a value > 0 (or None: no clipping)")
        self._form = StateForm(moments, master, min_8bit_size, min_4bit_size)
        if master == "remainder" and moments in ("int8", "int4"):
            raise ValueError(f"moments={moments!r} with master='remainder'; LAMB's remainder master takes float "
                             "moments (moments='float32' or 'bfloat16')")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, min_trust=min_trust,
                        max_trust=max_trust, bias_correction=bias_correction)
        self.max_grad_norm = max_grad_norm
        super().__init__(params, defaults)
        self._form.check([p for g in self.param_groups for p in g["params"]], amsgrad=False)

    def _init_plans(self):
        super()._init_plans()
        self._norm_check = None  # the gradient norm for max_grad_norm's clipping
        self._global_norm = None

    def _moment_names(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _release_native(self):
        super()._release_native()
        self._norm_check = self._global_norm = None

    def _cohort_key(self, index):
        return self._layout.group_of[index], self._form.quantized(self._layout.params[index])

    def _hyperparameters(self, g):
        return lamb_hyperparameters(g, self.max_grad_norm or 0.0)

    def _make_plan(self, indices, grads):
        weights, g, groups, copy, remainder = self._plan_lists(indices, grads)
        return gradkit.LambPlan(weights, g, self._state_list(indices, "exp_avg"),
                                self._state_list(indices, "exp_avg_sq"),
                                [self._hyperparameters(grp) for grp in self.param_groups], groups,
                                model_copy=copy, weight_remainder=remainder, hold_grads=False,
                                **self._absmax_lists(indices))

    def _clip_norm(self, stream):
        """The global gradient norm on the device, for LAMB's own clipping (None: no clipping)."""
        if not self.max_grad_norm:
            return None
        if self._norm_check is None:
            self._norm_check = GradientCheck(self)
            self._global_norm = gradkit.DeviceScalar(torch.empty(1, dtype=torch.float32, device=self._layout.device))
        self._norm_check.check(stream, global_norm=self._global_norm)
        return self._global_norm

    def _launch_all(self, cohorts, stream, found_inf, grad_divisor):
        # Under the fused mixed-precision step the divisor carries the clipping already.
        norm = self._clip_norm(stream) if grad_divisor is None else None
        shards = self._layout.shard_group()
        for c in cohorts:
            group = self.param_groups[self._layout.group_of[c.indices[0]]]
            args = dict(eta=float(group["lr"]), loss_scale_device=grad_divisor, gradient_norm_device=norm,
                        step_device=c.counter_scalar, found_inf=found_inf, stream=stream)
            if shards is None:
                c.plan.step(**args)
                continue
            # Sharded DTensors: pass 1 leaves this rank's sums of w^2 and d^2 per
            # tensor; every rank's, all-gathered and added in rank order, give
            # each whole tensor's trust ratio in pass 2.
            if c.sums is None:
                c.sums = RankRows(shards, 2 * len(c.indices), self._layout.device)
            c.plan.step(split="first", sums=c.sums.mine, **args)
            c.sums.gather()
            c.plan.step(split="second", sums=c.sums.rows, rows=c.sums.count, **args)


__all__ = ["Adam", "AdamW", "Lamb"]
