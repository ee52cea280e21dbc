"""Adam, AdamW and LAMB with the optimizer state in host memory and the step on the CPU
(gradkit.OffloadedAdam, gradkit.OffloadedLamb): for models whose state does not fit next
to them on the GPU.

The model's parameters and gradients stay on one CUDA device; float32 masters
and moments live on the host (0 bytes of optimizer state on the GPU). This
module only says when a bucket of gradients is complete; every number is
computed by gradkit (docs/offload.md):

- With torch >= 2.1, each parameter gets a post-accumulate-grad hook. From
  the second step on, a bucket is handed to gradkit as soon as all its
  gradients are final (each parameter's hook has fired as often as in the
  first step: a tied weight or gradient accumulation fires it more than
  once), so its copy to the host, its CPU step and the copy back overlap the
  rest of backward. The first step, and any torch without the hook, hands
  every bucket in step().
- Without a loss scaler and clipping, each bucket is updated as soon as it
  has arrived. With either, the copies still overlap backward, but step()
  first checks the whole gradient on the GPU (overflow, norm) and the
  updates follow it, bucket by bucket.
- A gradient changed after its bucket was handed (torch.nn.utils.clip_grad_norm_,
  GradScaler.unscale_ or a manual mul_ between backward and step(); seen by the
  tensor's version counter) is never lost without a word: with a check
  (loss_scaler or max_norm, whose updates wait for step()) the bucket is
  copied again as it is now, so the change applies; without one the update
  has already used the gradient, and step() raises a RuntimeError naming
  the remedy (max_norm=, or overlap=False).
- release=True (off by default: it changes what p.grad holds): each bucket's
  gradients are freed on the GPU as soon as they are handed (p.grad is set to
  None in the hook; the copy stream is recorded with the caching allocator),
  so the GPU holds a few buckets of gradients instead of all of them, from
  the first step on. p.grad is None after backward. Gradients made by later
  backward passes of the step (micro-batches) are handed too, and summed on
  the host in the gradient's dtype as torch sums them on the GPU; the
  check for loss_scaler / max_norm runs on the host over those sums.
  clip_grad_norm_ then finds no gradient (it returns 0): clip with max_norm=.
- Every parameter is updated at every step: a parameter without a gradient
  at step() is an error (torch.optim skips it; one step counter here).
- The param groups' "lr" is read when a step's first bucket is handed (by a
  hook during backward, or in step()): an lr scheduler stepped after
  step(), as torch documents, applies to the next step exactly; a change
  made between backward and step() applies from the step after.
- moments="float32" (default), "bfloat16", "int8" or (OffloadedAdam/AdamW)
  "int4" sets the host moments' form, as gradkit.torch.AdamW's `moments`
  does (8- or 4-bit here for every tensor: the host has no launch to save).
  Fewer bytes per parameter are fewer for the CPU step to move.
- state_dict() is torch.optim.AdamW's layout ("step", "exp_avg",
  "exp_avg_sq" per parameter, on the CPU; "master_param" for float16/bfloat16
  parameters, as gradkit.torch.AdamW's) with the moments in this optimizer's
  form: gradkit.torch.AdamW loads it, and so does torch.optim.AdamW for
  float32 moments; float32_state_dict() gives float32 moments whatever the
  form. load_state_dict takes any of those forms. OffloadedLamb's is
  gradkit.torch.Lamb's, likewise.
- OffloadedLamb: LAMB keeps one learning rate (eta) for all groups, so the
  groups' "lr" must agree at each step (a scheduler changing all of them
  alike is fine). Its max_norm clips the global norm as the other offloaded
  optimizers do (clip_grad_norm_, gradkit.MixedPrecisionLamb's way), not as
  gradkit.torch.Lamb's max_grad_norm (LAMB's own clipping).
"""
import functools
import weakref

import torch

import gradkit
from gradkit.torch import _compile
from gradkit.torch._device import common_device, stream_handle
from gradkit.torch._state_forms import StateForm, absmax4_name, absmax_name, check_int4_map, mark_int4_map, step_count
from gradkit.torch._param_groups import adam_hyperparameters, closure_loss, lamb_hyperparameters

_MOMENT_DTYPES = {"float32": gradkit.DType.f32, "bfloat16": gradkit.DType.bf16, "int8": gradkit.DType.u8,
                  "int4": gradkit.DType.u8}

_HAS_HOOK = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")


def _on_grad(ref, index, _param):
    """A parameter's post-accumulate-grad hook (holds the optimizer weakly)."""
    optimizer = ref()
    if optimizer is not None:
        optimizer._gradient_accumulated(index)


class _OffloadedBase(torch.optim.Optimizer):
    """What the offloaded optimizers share; a subclass gives _hyperparameters(group),
    _make_native(groups, **options) and _apply_lrs()."""

    def __init__(self, params, defaults, *, moments="float32", bucket_mb=32.0, piece_mb=32.0, buckets=None,
                 loss_scaler=None, max_norm=0.0, overlap=True, host_threads=0, release=False):
        # Every tensor's moments in the form, whatever its size; raises on an unknown form, naming it.
        self._form = StateForm(moments=moments, min_8bit_size=0, min_4bit_size=0)
        if release and not (overlap and _HAS_HOOK):
            raise ValueError("release=True frees each bucket's gradients as backward's hooks hand them, so it needs "
                             "overlap=True and torch >= 2.1 (register_post_accumulate_grad_hook)")
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        if not self._params:
            raise ValueError("the optimizer has no parameters")
        self._form.check(self._params, self._amsgrad())
        self._device = common_device(self._params, "params")
        if self._device.type != "cuda":
            raise TypeError(f"params[0] is on {self._device}, expected a CUDA device: the offloaded optimizer keeps "
                            "the model on the GPU and its state on the host (gradkit.torch.AdamW steps CPU models)")
        for i, p in enumerate(self._params):
            if not p.is_contiguous():
                raise ValueError(f"params[{i}] is not contiguous; expected contiguous parameters")
        if not (bucket_mb > 0):
            raise ValueError(f"bucket_mb is {bucket_mb}, expected > 0")
        if not (piece_mb > 0):
            raise ValueError(f"piece_mb is {piece_mb}, expected > 0")
        # The C++ optimizer needs the gradients' shapes and dtypes now, when
        # torch may not have made them: the parameters stand in (torch's
        # gradients have their parameter's shape and dtype), and every
        # bucket_ready below passes the gradients of the moment.
        groups = [{"params": [p.detach() for p in g["params"]], "grads": [p.detach() for p in g["params"]],
                   "hyperparameters": self._hyperparameters(g)} for g in self.param_groups]
        bits = {"moment_bits": 4} if moments == "int4" else {}
        self._native = self._make_native(groups, moment_dtype=_MOMENT_DTYPES[moments], buckets=buckets, **bits,
                                         bucket_bytes=int(bucket_mb * 2 ** 20),
                                         piece_bytes=max(1, int(piece_mb * 2 ** 20)),
                                         scaler=loss_scaler, max_norm=float(max_norm),
                                         host_threads=int(host_threads), release=bool(release))
        self._release = bool(release)
        # With release, the caching allocator must know that gradkit's copy stream reads a freed gradient.
        self._copy_stream = (torch.cuda.ExternalStream(self._native.copy_stream, device=self._device)
                             if self._release else None)
        self._bucket_of = self._native.bucket_of_tensor
        self._bucket_tensors = [self._native.bucket_tensors(b) for b in range(self._native.num_buckets)]
        self._lrs = [g["lr"] for g in self.param_groups]
        self._loss_scale = None
        self._refresh = False  # the masters are to be taken from the weights before the next step's first bucket
        self._expected = None  # how often each parameter's hook fires in a step (learned at the first)
        self._new_step()
        self._hooks = []
        if overlap and _HAS_HOOK:
            ref = weakref.ref(self)
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref, i))
                           for i, p in enumerate(self._params) if p.requires_grad]

    def _amsgrad(self):
        return any(g.get("amsgrad", False) for g in self.param_groups)

    def _new_step(self):
        self._counts = [0] * len(self._params)
        self._handed = [False] * len(self._bucket_tensors)
        self._complete = [False] * len(self._bucket_tensors)  # handed as complete: its update may have begun
        self._remaining = [len(t) for t in self._bucket_tensors]
        self._fresh = [False] * len(self._params)  # release: a gradient made since its bucket's last hand
        self._handed_grads = {}  # without release: params[t] -> (its gradient when handed, that tensor's version)

    # -- handing buckets ---------------------------------------------------------

    def _gradient_accumulated(self, index):
        self._counts[index] += 1
        bucket = self._bucket_of[index]
        if self._release:
            # Every gradient made is handed (the GPU keeps none): a bucket goes once each of its
            # tensors has a gradient since its last hand; the sums over micro-batches are kept on
            # the host. A bucket is complete once every hook fired as often as at the first step.
            if self._complete[bucket] or self._fresh[index]:
                return  # a late gradient (step() says so), or one more part of a gradient not yet handed
            self._fresh[index] = True
            self._remaining[bucket] -= 1
            if self._remaining[bucket] == 0:
                self._hand(bucket, complete=self._bucket_done(bucket))
            return
        if self._expected is None or self._counts[index] != self._expected[index]:
            return
        self._remaining[bucket] -= 1
        if self._remaining[bucket] == 0:
            self._hand(bucket)

    def _bucket_done(self, bucket):
        return self._expected is not None and all(self._counts[t] >= self._expected[t]
                                                  for t in self._bucket_tensors[bucket])

    def _hand(self, bucket, complete=True):
        again = self._handed[bucket]
        grads = []
        for t in self._bucket_tensors[bucket]:
            g = self._params[t].grad
            if g is None:
                if not (self._release and again):
                    raise ValueError(f"params[{t}] has no gradient; the offloaded optimizer updates every parameter "
                                     "at every step")
                g = torch.zeros_like(self._params[t])  # no more of its gradient since the bucket's last hand
            if g.device != self._device or g.dtype != self._params[t].dtype or not g.is_contiguous():
                raise TypeError(f"params[{t}].grad is {g.dtype} on {g.device}, expected a contiguous "
                                f"{self._params[t].dtype} gradient on {self._device}")
            grads.append(g)
        if not any(self._handed):
            # The step's first bucket: its CPU step may run at once (no check), so the
            # param groups' lr (a scheduler's change since the last step) applies now.
            self._apply_lrs()
        if self._refresh:
            self._native.refresh_masters()
            self._refresh = False
        self._native.bucket_ready(bucket, stream_handle(self._device), [g.detach() for g in grads], complete)
        if self._release:
            for t, g in zip(self._bucket_tensors[bucket], grads):
                g.record_stream(self._copy_stream)  # freed now; reused only once the copy has read it
                self._params[t].grad = None
                self._fresh[t] = False
            self._remaining[bucket] = len(self._bucket_tensors[bucket])
        else:
            for t, g in zip(self._bucket_tensors[bucket], grads):
                self._handed_grads[t] = (g, g._version)
        self._handed[bucket] = True
        self._complete[bucket] = self._complete[bucket] or complete

    def _changed_after_hand(self):
        """The params whose gradient changed since it was handed (clip_grad_norm_, a manual mul_):
        another tensor now, or an in-place change (its version counter moved)."""
        return sorted(t for t, (g, version) in self._handed_grads.items()
                      if self._params[t].grad is not g or g._version != version)

    # -- torch.optim.Optimizer ---------------------------------------------------

    @_compile.eager_only  # under torch.compile: a graph break, the step run as it is
    @torch.no_grad()
    def step(self, closure=None):
        """Hands the buckets backward has not handed, and makes the current stream wait for
        every updated weight (the host waits for the CPU steps)."""
        loss = closure_loss(closure)
        changed = self._changed_after_hand()
        if changed and self._native.checks_gradients:
            # The updates wait for the check in finish(): hand those buckets again, as they are now.
            for b in sorted({self._bucket_of[t] for t in changed}):
                self._hand(b)
            changed = []
        for b, handed in enumerate(self._handed):
            if not handed:
                self._hand(b)
            elif self._release and not self._complete[b] and any(
                    self._params[t].grad is not None for t in self._bucket_tensors[b]):
                self._hand(b)  # what came since its last hand (a tensor's later parts)
        self._native.finish(stream_handle(self._device))
        late = []
        if self._expected is None:
            self._expected = [max(c, 1) for c in self._counts]
        else:
            late = [i for i, c in enumerate(self._counts) if c > self._expected[i]]
        self._new_step()
        if late:
            raise RuntimeError(f"params{late[:8]} got gradients after their bucket was handed (their hooks fired "
                               "more often than at the first step), so this step used partial gradients; pass "
                               "overlap=False when the number of backward passes per step changes" +
                               (" (release=True needs overlap: keep the number of backward passes per step)"
                                if self._release else ""))
        if changed:
            raise RuntimeError(
                f"the gradients of params{changed[:8]} changed after the offloaded optimizer had copied them to "
                "the host (torch.nn.utils.clip_grad_norm_ or an in-place change between backward and step()), so "
                "this step's update used them as they were before the change. Clip with the optimizer's own "
                "max_norm= instead (and with Hugging Face Trainer, TrainingArguments(max_grad_norm=0)), or pass "
                "overlap=False to hand every gradient at step()")
        return loss

    @property
    def loss_scale(self):
        """The loss scale S as a 0-dim float32 tensor on the GPU (multiply the loss by it), or None."""
        if self._loss_scale is None and self._native.loss_scale_device is not None:
            self._loss_scale = torch.from_dlpack(self._native.loss_scale_device).view(())
        return self._loss_scale

    @property
    def last_step_skipped(self):
        return self._native.last_step_skipped

    @property
    def native(self):
        """The gradkit.OffloadedAdam or OffloadedLamb underneath (host_bytes, device_bytes, save, load).
        Its load() takes the learning rates from the file, but the param groups keep theirs and
        are applied again once they change: use load_state_dict to move the lr too."""
        return self._native

    def _moment_names(self):
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self._amsgrad() else [])

    def _host_arrays(self):
        """The native optimizer's host arrays by state key (masters as "master_param")."""
        arrays = {name: getattr(self._native, name) for name in self._moment_names()}
        if self._form.moments in ("int8", "int4"):
            key = absmax_name if self._form.moments == "int8" else absmax4_name
            for name in ("exp_avg", "exp_avg_sq"):
                arrays[key(name)] = getattr(self._native, absmax_name(name))
        if self._params[0].dtype in (torch.float16, torch.bfloat16):
            arrays["master_param"] = self._native.masters
        return arrays

    def state_dict(self):
        """torch.optim.AdamW's layout, the state on the CPU (copies of the host state), the
        moments in this optimizer's form."""
        self._native.synchronize()
        step = torch.tensor(float(self._native.step_count))
        arrays = self._host_arrays()
        for i, p in enumerate(self._params):
            s = {"step": step.clone()}
            for name, values in arrays.items():
                t = torch.from_dlpack(values[i])
                # An absmax, and 4-bit codes (two a byte), stay flat; the rest is shaped like p.
                flat = "_absmax" in name or (self._form.moments == "int4" and name in ("exp_avg", "exp_avg_sq"))
                s[name] = (t if flat else t.view(p.shape)).clone()
            self.state[p] = mark_int4_map(s)
        out = super().state_dict()
        self.state.clear()  # the state lives in gradkit's host memory
        scaler = self._native.scaler_state()
        if scaler is not None:
            out["gradkit_loss_scaler"] = list(scaler)
        return out

    def float32_state_dict(self):
        """state_dict() with float32 moments (decoded from 8-bit or bfloat16): torch.optim.AdamW's
        layout, plus "master_param" for float16/bfloat16 parameters."""
        out = self.state_dict()
        names = self._moment_names()
        keys = [k for g in out["param_groups"] for k in g["params"]]
        for key, p in zip(keys, self._params):
            out["state"][key] = self._form.to_float32(_host_proxy(p), names, out["state"][key])
        return out

    def load_state_dict(self, state_dict):
        """Loads torch.optim.AdamW's layout (from this class, gradkit.torch.AdamW or torch.optim.AdamW),
        the moments in any form (float32, bfloat16, 8-bit, 4-bit), converted into this optimizer's by
        gradkit's encoders. Everything is checked and converted before anything is written. The
        masters of float32 weights are the weights: they are taken from the model at the next step
        (load the model's weights first or after, either works); float16/bfloat16 masters come from
        "master_param", or from the weights when the state has none (torch.optim's)."""
        check_int4_map(state_dict)
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, expected {len(self.param_groups)}")
        keys = [k for g in saved_groups for k in g["params"]]
        if len(keys) != len(self._params):
            raise ValueError(f"state_dict has {len(keys)} params, expected {len(self._params)}")
        names = ["exp_avg", "exp_avg_sq"]
        if any(g.get("amsgrad", False) for g in saved_groups):
            names.append("max_exp_avg_sq")
        low = self._params[0].dtype in (torch.float16, torch.bfloat16)
        steps, masters = set(), []
        converted = []
        for i, (key, p) in enumerate(zip(keys, self._params)):
            s = state_dict["state"].get(key)
            if s is None:
                raise ValueError(f"state_dict has no state for params[{i}]; expected the state of a stepped optimizer")
            for name in names + (["master_param"] if low and "master_param" in s else []):
                # 4-bit codes (with their absmax4) are flat, two a byte.
                n = gradkit.quant4_bytes(p.numel()) if absmax4_name(name) in s else p.numel()
                if name not in s or s[name].numel() != n:
                    raise ValueError(f"state_dict's state of params[{i}] has no '{name}' of {n} elements")
            masters.append(s.get("master_param"))
            steps.add(step_count(s.get("step"), f"state_dict['state'][{key!r}]"))
            moments = {k: v for k, v in s.items() if k in names or k.endswith(("_absmax", "_absmax4"))}
            self._form.convert_moments(_host_proxy(p), names, moments)  # into this form, on the host
            for name in names:
                for key, blocks in ((absmax_name(name), gradkit.quant_blocks(p.numel())),
                                    (absmax4_name(name), gradkit.quant4_blocks(p.numel()))):
                    if key in moments and moments[key].numel() != blocks:
                        raise ValueError(f"state_dict's state of params[{i}] has a '{key}' of "
                                         f"{moments[key].numel()} elements, expected {blocks}")
            converted.append(moments)
        if len(steps) != 1:
            raise ValueError(f"state_dict's params have step counts {sorted(steps)}; the offloaded optimizer "
                             "keeps one count for all")
        if any(g.get("amsgrad", False) for g in saved_groups) and not self._amsgrad():
            raise ValueError("state_dict uses amsgrad, but this optimizer was made without it")
        self._native.step_count = steps.pop()
        targets = {k: v for k, v in self._host_arrays().items() if k != "master_param"}
        for i, moments in enumerate(converted):
            for name, array in targets.items():
                if name in moments:
                    torch.from_dlpack(array[i]).copy_(moments[name].reshape(-1))
        if low and all(m is not None for m in masters):
            for array, m in zip(self._native.masters, masters):
                torch.from_dlpack(array).copy_(m.reshape(-1))
        else:
            self._refresh = True  # f32: the weights are the masters; f16/bf16 without masters: start from them
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        scaler = state_dict.get("gradkit_loss_scaler")
        if scaler is not None and self._native.scaler_state() is not None:
            self._native.set_scaler_state(*scaler)

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled or deep-copied (its state is in gradkit's "
                        "host memory); use state_dict()")


def _host_proxy(p):
    """A host tensor standing in for p where a state conversion needs only its shape and dtype
    (and puts what it makes on the host, where the offloaded state lives)."""
    return torch.empty(p.shape, dtype=p.dtype)


class _OffloadedAdamBase(_OffloadedBase):
    _decay = None  # gradkit.WeightDecay, set by the subclass

    def __init__(self, params, lr, betas, eps, weight_decay, amsgrad, maximize, **offload):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults, **offload)

    def _make_native(self, groups, **options):
        return gradkit.OffloadedAdam(groups, **options)

    def _hyperparameters(self, g):
        return adam_hyperparameters(g, self._decay)

    def _apply_lrs(self):
        for g, group in enumerate(self.param_groups):
            if group["lr"] != self._lrs[g]:  # an lr scheduler's change
                self._native.set_lr(g, float(group["lr"]))
                self._lrs[g] = group["lr"]


class OffloadedAdamW(_OffloadedAdamBase):
    """torch.optim.AdamW's update (decoupled weight decay) with the state on the host and the
    step on the CPU. Keyword-only: moments ("float32", "bfloat16", "int8" or "int4": the host
    moments' form), bucket_mb (gradient bytes per bucket, buckets cut from the
    last parameter to the first), piece_mb (within a bucket, the copies and the CPU step go in
    pieces of this many gradient bytes, so that they overlap each other), buckets (each
    parameter's bucket instead), loss_scaler
    (gradkit.LossScalerOptions: the loss scale is .loss_scale), max_norm (clip the global norm),
    overlap (hand buckets from backward's hooks; torch >= 2.1), host_threads (threads of the CPU
    step; 0: every core but two), release (free each bucket's gradients on the GPU once handed:
    p.grad is None after backward; the module's docstring)."""

    _decay = gradkit.WeightDecay.decoupled

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 maximize=False, **offload):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, **offload)


class OffloadedAdam(_OffloadedAdamBase):
    """torch.optim.Adam's update (L2 weight decay) with the state on the host; as OffloadedAdamW."""

    _decay = gradkit.WeightDecay.l2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 maximize=False, **offload):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize, **offload)


class OffloadedLamb(_OffloadedBase):
    """gradkit.torch.Lamb's update (ONNX Runtime's LAMB: per-tensor trust ratio clamped to
    [min_trust, max_trust], weight decay inside the update) with the state on the host and
    the step on the CPU. Keyword-only options as OffloadedAdamW's (moments, bucket_mb,
    piece_mb, buckets, loss_scaler, max_norm, overlap, host_threads, release). LAMB's pieces hold whole
    tensors (the trust ratio needs each tensor's norms), so piece_mb never cuts a tensor. One
    learning rate for all groups (LAMB's eta)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, *,
                 min_trust=float("-inf"), max_trust=float("inf"), bias_correction=True, **offload):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, min_trust=min_trust,
                        max_trust=max_trust, bias_correction=bias_correction)
        super().__init__(params, defaults, **offload)

    def _make_native(self, groups, **options):
        return gradkit.OffloadedLamb(groups, eta=float(self._common_lr()), **options)

    def _hyperparameters(self, g):
        # LAMB's own clipping gets no norm here: max_norm clips globally (the class's docstring).
        return lamb_hyperparameters(g, 0.0)

    def _common_lr(self):
        lrs = sorted({float(g["lr"]) for g in self.param_groups})
        if len(lrs) != 1:
            raise ValueError(f"param_groups have learning rates {lrs}; OffloadedLamb keeps one (LAMB's eta) for all "
                             "groups")
        return lrs[0]

    def _apply_lrs(self):
        lr = self._common_lr()
        if lr != self._lrs[0]:  # an lr scheduler's change
            self._native.eta = lr
            self._lrs = [lr] * len(self._lrs)
