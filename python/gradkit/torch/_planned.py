"""The planned optimizer that gradkit.torch's optimizers are made of (Adam, AdamW and
LAMB in gradkit.torch.optim, Muon in gradkit.torch.muon): torch.optim.Optimizer
subclasses over gradkit's plans.

Every number is computed by gradkit (AdamPlan, LambPlan, GradientCheckPlan);
this module only decides which plans to make and when to re-point them:

- The parameters that have a gradient and have taken the same number of
  steps form a *cohort*, stepped by one plan with one step counter on the
  device (torch.optim keeps a step per parameter; a parameter whose .grad is
  None is skipped, so its count falls behind and it joins another cohort).
  Usually every parameter has a gradient every step: one cohort, one plan.
- A step looks at where each parameter's data and .grad are, not at their
  values, following what param_groups[i]["params"] holds now: if the
  addresses are those of the last step (the same tensors, or new gradients
  in the same memory, which is what zero_grad(set_to_none=True) and the
  caching allocator give), the plans are launched as they are; if only the
  gradients moved, the plans are re-pointed (one table upload each); if the
  set of parameters with gradients changed, the cohorts are made anew; if a
  parameter changed (`p.data = ...`, a group's "params" edited), the layout
  is made anew and checked as at construction.
  With flat gradients (gradkit.torch.flat_gradients) not even the pointers
  are read: the host cost of a step does not depend on the tensor count.
- float16/bfloat16 parameters get float32 master weights (ONNX Runtime's
  FP16_Optimizer, Apex's master params): the state holds "master_param"
  (made from the parameter at its first step) and float32 moments; the
  update reads the f16/bf16 gradients, updates the masters and writes the
  rounded parameter in the same pass.
- Learning rates live in a float32 tensor on the device (one per group),
  rewritten only when a group's "lr" changed (lr schedulers work), and step
  counters are int64 on the device, advanced only by a step that is not
  skipped for an overflow (the fused mixed-precision step).
- DTensor parameters (FSDP2): every plan is over the local shards, and the
  state is made like the parameters (DTensors, as torch.optim's under
  FSDP2, so torch.distributed.checkpoint saves it); LAMB's trust ratios and
  the gradient check's norm become collectives over the shards (_dtensor).
"""
from collections import OrderedDict
from contextlib import contextmanager

import torch

import gradkit
from gradkit.torch import _compile
from gradkit.torch._device import stream_handle
from gradkit.torch._dtensor import local, local_data_ptr
from gradkit.torch._layout import Layout
from gradkit.torch._param_groups import closure_loss
from gradkit.torch._state_forms import (StateForm, check_int4_map, check_moments, float_master,
                                        step_count)


# torch's C++ check that tensors' data pointers are given ones (2.11 has it, 1.13 not; it takes
# tensors only, not None); without it a step compares Python lists of data_ptr().
_data_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class _Cohort:
    """Parameters stepped together by one plan; they share their step count."""

    __slots__ = ("indices", "counter", "counter_scalar", "plan", "sums")

    def __init__(self, indices, counter, plan):
        self.indices = indices  # positions in the optimizer's flat parameter list
        self.counter = counter  # int64 tensor of one element on the parameters' device
        self.counter_scalar = gradkit.DeviceScalar(counter)  # the same memory, converted once
        self.plan = plan
        self.sums = None  # LAMB over sharded DTensors: the ranks' rows of per-tensor sums (RankRows)


@contextmanager
def _torch_hooks(optimizer, kind):
    """torch's pre and post hooks of `kind` ("state_dict", "load_state_dict") taken out of
    `optimizer` for the block, which runs them itself where gradkit's state is what the
    steps use (torch's own method would run them before gradkit converts the state);
    empty lists under a torch without such hooks."""
    names = [f"_optimizer_{kind}_pre_hooks", f"_optimizer_{kind}_post_hooks"]
    held = {n: optimizer.__dict__[n] for n in names if n in optimizer.__dict__}
    for n in held:
        optimizer.__dict__[n] = OrderedDict()
    try:
        yield [list(held[n].values()) if n in held else [] for n in names]
    finally:
        optimizer.__dict__.update(held)


class _PlannedOptimizer(torch.optim.Optimizer):
    """What Adam, AdamW and Lamb share: layout, cohorts, gradients, state I/O.

    A subclass names its per-parameter state tensors (_moment_names), makes a
    plan for a cohort (_make_plan), launches it (_launch), maps a group to
    gradkit hyperparameters (_hyperparameters), and says whether its step
    counter holds the completed steps or the next t (_counter_offset).
    """

    _counter_offset = 0  # counter value = completed steps + offset
    _copied_attributes = ()  # a subclass's settings outside `defaults`, kept by copy.deepcopy and pickle
    _form = StateForm()  # how the moments and masters are stored (a subclass may set its own)
    # Whether float32 and bfloat16 parameters may share the optimizer (its _cohort_key then
    # splits them: a plan takes one dtype).
    _mixed_dtypes = False

    def __init__(self, params, defaults):
        self._init_plans()
        super().__init__(params, defaults)

    def _init_plans(self):
        """No plans yet: made at the first step from the parameters and state."""
        self._layout = None
        self._cohorts = []
        self._present = None     # which parameters had a gradient at the last step
        self._keys = None        # where each parameter's data and gradient were (_step_keys)
        self._key_indices = []   # 0 .. n-1, for _same_addresses
        self._missing_grads = True
        self._cohort_version = 0   # changes when the cohorts are made anew
        self._pointer_version = 0  # changes when any plan's gradients change (re-pointed or made anew)
        self._flat = None        # FlatGradients covering every parameter, if given
        self._fused_step = None  # set by AmpStep.step for the length of its call to step()
        self._hyper_key = None
        self._lrs = None
        self._lr_device = None
        self._lr_scalar = None
        self._graph_handle = _compile.register(self)  # for gradkit::step_ (torch.compile)
        self._capturing = False  # a CUDA graph is being recorded over the step in progress
        self._graph_param_ptrs = None  # the parameters a compiled graph handed the last step
        self._graph_indices = None  # their positions in the layout (None: all of them, in order)
        self._graph_grads = None  # the gradients a compiled graph handed the step in progress

    # -- torch.optim.Optimizer -------------------------------------------------

    def __getstate__(self):
        """torch's (defaults, state, param_groups), the step counts written into the state
        first: copy.deepcopy and pickle give an optimizer that goes on where this one is
        (its plans are made anew at its first step)."""
        self._write_steps_to_state()
        state = super().__getstate__()
        state.update({name: getattr(self, name) for name in self._copied_attributes})
        return state

    def __setstate__(self, state):
        self._init_plans()
        super().__setstate__(state)
        for group in self.param_groups:  # groups pickled by an older gradkit may lack a key
            self._loaded_group(group)

    def add_param_group(self, param_group):
        """As torch's, then the parameters checked as a step takes them (dtype, device,
        contiguity: a named error now, not at the first step); a refused group is not added."""
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1)
            Layout(self.param_groups, self._mixed_dtypes)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        finally:
            self._invalidate()

    def _check_group(self, index):
        """Refuses a group's hyperparameter out of range (Adam's and LAMB's; Muon has its own)."""
        g = self.param_groups[index]
        _check_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"], f"param_groups[{index}]: ")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure()'s loss.
        Called by gradkit.torch.AmpStep.step() too (so that torch's step hooks, LR schedulers
        and wrappers of optimizer.step see its steps), which then makes it the fused
        mixed-precision step."""
        loss = closure_loss(closure)
        if _compile.is_compiling():
            _compile.graph_step(self)
        elif self._fused_step is not None:
            self._fused_step()
        else:
            self._step_with()
        return loss

    # -- torch.compile (gradkit.torch._compile) ----------------------------------

    def _graph_gradients(self, params, grads):
        """The gradients a compiled graph handed gradkit::step_, one per layout parameter (None
        where it handed none), after checking that `params` are this optimizer's parameters
        themselves, in order (the step updates those in place: a copy, which functionalization
        could make, would be updated in vain): RuntimeError otherwise. The check runs again
        only when the parameters' addresses change."""
        ptrs = [p.data_ptr() for p in params]
        if ptrs != self._graph_param_ptrs:
            layout = self._current_layout()
            at = {p.data_ptr(): i for i, p in enumerate(layout.params)}
            indices = [at.get(q, -1) for q in ptrs]
            if len(grads) != len(params) or -1 in indices or indices != sorted(set(indices)):
                raise RuntimeError(f"a compiled graph handed {type(self).__name__}'s step other tensors than its "
                                   "parameters (copies, or a stale graph); gradkit updates the parameters in "
                                   "place and cannot step copies")
            self._graph_indices = None if indices == list(range(len(layout.params))) else indices
            self._graph_param_ptrs = ptrs
        if self._graph_indices is None:  # every parameter has its gradient: the common case
            return grads
        out = [None] * len(self._layout.params)
        for i, g in zip(self._graph_indices, grads):
            out[i] = g
        return out

    def _step_in_graph(self, params, grads, fused=None):
        """gradkit::step_'s implementation: the eager step over what the graph handed it.
        `fused`: AmpStep's (found_inf, grad_divisor, check)."""
        grads = self._graph_gradients(params, grads)
        self._capturing = self._get_layout().device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self._graph_grads = grads
        try:
            self._step_with(*(fused or (None, None, None)), grads=grads)
        finally:
            self._capturing = False
            self._graph_grads = None  # not held past the step

    def _release_native(self):
        """Drops every gradkit object this optimizer holds (at exit: gradkit.torch._compile);
        the steps taken are kept in the state, and a later step would plan anew."""
        self._invalidate()
        self._lr_device = self._lr_scalar = None
        self._flat = None

    def _refuse_in_capture(self, what):
        if self._capturing:
            raise RuntimeError(f"{type(self).__name__}: {what} while a CUDA graph records its step (torch.compile "
                               "mode='reduce-overhead'); gradkit re-plans a step only outside a recording. "
                               "Keep the gradients where they are between steps (flat_gradients, or "
                               "zero_grad(set_to_none=False)) or compile without CUDA graphs")

    def zero_grad(self, set_to_none=True):
        """As torch's, except that flat gradients stay in place and are zeroed in one launch."""
        if self._flat is not None and self._flat.attached():
            self._flat.zero_()
            return
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """torch's layout: per parameter "step" (a float32 tensor) and the state tensors in
        this optimizer's form (8-bit moments stay 8-bit: it round-trips bit for bit). For a
        DTensor parameter (FSDP2), 8-bit moments and remainder masters leave as float32
        DTensors shaped like it, which torch.distributed.checkpoint can reshard (each rank's
        absmax covers its own blocks; int16 is no collective's type); loading encodes them
        again, into the same codes and remainders when the sharding is the same.
        torch's state_dict hooks run as under torch: the pre hooks see the state with its
        step counts, the post hooks the dict this returns."""
        self._write_steps_to_state()
        with _torch_hooks(self, "state_dict") as (pre_hooks, post_hooks):
            for hook in pre_hooks:
                hook(self)
            out = super().state_dict()
        saved_ids = [i for g in out["param_groups"] for i in g["params"]]
        for key, (p, group) in zip(saved_ids, self._params_with_groups()):
            if key in out["state"] and self._form.portable_differs(p):
                out["state"][key] = self._form.portable(p, self._moment_names(group), out["state"][key])
        for hook in post_hooks:
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def float32_state_dict(self):
        """state_dict() with float32 moments (decoded from 8-bit or bfloat16) and, for
        float16/bfloat16 parameters, float32 "master_param": what a float32 gradkit
        optimizer holds, and torch.optim.AdamW's layout for float32 parameters."""
        out = self.state_dict()
        saved_ids = [i for g in out["param_groups"] for i in g["params"]]
        for key, (p, group) in zip(saved_ids, self._params_with_groups()):
            if key in out["state"]:
                out["state"][key] = self._form.to_float32(p, self._moment_names(group), out["state"][key])
        return out

    def state_bytes(self):
        """Bytes of the state tensors this optimizer holds (moments, absmax, masters or
        remainders; on this rank for DTensors)."""
        return sum(local(t).numel() * t.element_size() for s in self.state.values() if isinstance(s, dict)
                   for k, t in s.items() if k != "step" and torch.is_tensor(t))

    def _params_with_groups(self):
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def load_state_dict(self, state_dict):
        """Loads torch's layout: from this class in any state form (float32, bfloat16 or 8-bit
        moments; float32 or remainder masters), converted into this optimizer's, from
        torch.optim's counterpart (float32 moments, no masters: they start from the weights),
        or from another optimizer whose state holds what this one needs (LAMB's into AdamW).
        As torch does, a group key the saved groups lack (a checkpoint of an older torch or of
        another optimizer) keeps this optimizer's value. Everything is checked before anything
        is replaced: a state this optimizer cannot step (moments missing or of another shape,
        a step count that is not a whole number >= 0) is refused, naming it. Loading a float32
        master into the remainder form sets the parameter to its rounding. torch's
        load_state_dict hooks run as under torch: the post hooks see, and may change, the
        state as the steps will use it."""
        with _torch_hooks(self, "load_state_dict") as (pre_hooks, post_hooks):
            state_dict = dict(state_dict)  # shallow, as torch's: a pre hook may change it
            for hook in pre_hooks:
                result = hook(self, state_dict)
                if result is not None:
                    state_dict = result
            state_dict = self._checked_for_loading(state_dict)
            saved = self._saved_tensors(state_dict)
            self._cohorts = []  # their counters describe the state being replaced
            super().load_state_dict(state_dict)  # casts every state tensor to its parameter's dtype
            for p, values in saved.items():
                self.state[p].update(values)
            for p, group in self._params_with_groups():
                if self.state.get(p):
                    self._form.convert(p, self._moment_names(group), self.state[p])
            self._invalidate()
        for hook in post_hooks:
            hook(self)

    def _checked_for_loading(self, state_dict):
        """state_dict with each saved group completed by this optimizer's keys (a key the saved
        group has wins), after checking that every parameter's state fits: ValueError or
        TypeError naming the group or the state, before anything is loaded."""
        check_int4_map(state_dict)
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"state_dict has no {key!r}; expected an optimizer's state_dict()")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, expected {len(self.param_groups)} "
                             "(this optimizer's)")
        groups = []
        for i, (mine, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"state_dict's param_groups[{i}] has {len(saved['params'])} parameters, expected "
                                 f"{len(mine['params'])} (this optimizer's group {i})")
            group = {**{k: v for k, v in mine.items() if k != "params"}, **saved}
            self._loaded_group(group)
            groups.append(group)
        saved_state = state_dict["state"]
        for group, mine in zip(groups, self.param_groups):
            for key, p in zip(group["params"], mine["params"]):
                if saved_state.get(key):
                    self._check_state(p, group, saved_state[key], f"state_dict['state'][{key!r}]")
        return {**state_dict, "param_groups": groups}

    def _loaded_group(self, group):
        """A subclass's say over a loaded or unpickled group (Adam's weight decay, as torch's)."""

    def _check_state(self, p, group, state, where):
        """Refuses, naming `where`, a parameter's state that this optimizer cannot step: no
        whole step count >= 0, or moments missing or not shaped for p (_state_forms)."""
        if not isinstance(state, dict):
            raise TypeError(f"{where} is a {type(state).__name__}, expected a dict of the parameter's state")
        step_count(state.get("step"), where)
        check_moments(p, self._moment_names(group), state, where)

    def _saved_tensors(self, state_dict):
        """The state tensors whose dtype is not their parameter's, as saved: torch's
        load_state_dict casts every state tensor to its parameter's dtype, which would
        round float32 masters and moments of float16/bfloat16 parameters and turn 8-bit
        codes and remainders into floats."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict.get("param_groups", []) for i in g["params"]]
        out = {}
        for key, p in zip(saved_ids, params):
            if key in state_dict.get("state", {}):
                out[p] = {k: v.to(device=p.device, copy=True)  # never shared with the source
                          for k, v in state_dict["state"][key].items()
                          if k != "step" and torch.is_tensor(v) and v.dtype != p.dtype}
        return out

    # -- gradients -------------------------------------------------------------

    def use_flat_gradients(self, flat):
        """Steps over `flat` (a gradkit.torch.FlatGradients covering every parameter)
        without reading each .grad per step."""
        layout = self._get_layout()
        if layout.dtensors:
            raise TypeError("flat gradients do not cover DTensor parameters (FSDP2 shards the gradients itself); "
                            "step them from their .grad")
        if set(map(id, flat.params)) != set(map(id, layout.params)):
            raise ValueError("the flat gradients do not cover exactly this optimizer's parameters")
        self._flat = flat
        self._invalidate()

    def _get_layout(self):
        """The layout of the parameters, made when first needed (a step): not over parameters
        still on the meta device, which have no data to step (a named error)."""
        if self._layout is None:
            layout = Layout(self.param_groups, self._mixed_dtypes)
            layout.refuse_meta()
            self._form.check(layout.params, any(g.get("amsgrad", False) for g in self.param_groups))
            self._layout = layout
        return self._layout

    def _invalidate(self):
        """Forget the cohorts (their steps are kept in self.state)."""
        if getattr(self, "_cohorts", None):
            self._write_steps_to_state()
        self._layout = None
        self._cohorts = []
        self._present = None
        self._keys = None
        self._hyper_key = None
        self._lrs = None
        self._cohort_version = getattr(self, "_cohort_version", 0) + 1
        self._pointer_version = getattr(self, "_pointer_version", 0) + 1

    def _prepare(self, stream, grads=None):
        """The cohorts to launch this step, with their plans pointing at the current gradients
        (a re-point is enqueued on `stream`, before the launches). `grads`: one per parameter
        (None: no gradient), as a compiled graph hands them; default: each parameter's .grad."""
        layout = self._get_layout()
        if self._flat is not None and self._cohorts and self._flat.attached_cheap() and \
                layout.ends_hold(self.param_groups):
            return self._cohorts
        if grads is None:
            params = [p for g in self.param_groups for p in g["params"]]
            if self._same_addresses(params):
                return self._cohorts
            keys = self._step_keys(params)
            if keys == self._keys:
                return self._cohorts
            layout = self._current_layout()
            params = layout.params
            grads = [local(p.grad) for p in params] if layout.dtensors else [p.grad for p in params]
        else:
            # A compiled graph's parameters were checked against the layout (_graph_gradients).
            keys = ([-1 if g is None else g.data_ptr() for g in grads], None)
            if keys == self._keys:
                return self._cohorts
            params = layout.params
        self._refuse_in_capture("the gradients moved since the last step")
        self._check_grads(params, grads)
        present = [g is not None for g in grads]
        if present == self._present:  # the same gradients present, some elsewhere: re-point
            for c in self._cohorts:
                c.plan.set_grads(self._grad_arrays(grads, c.indices), hold_grads=False, stream=stream)
            self._set_keys(keys)
            self._pointer_version += 1
            return self._cohorts
        self._make_cohorts(grads, present)
        self._set_keys(keys)
        return self._cohorts

    def _set_keys(self, keys):
        self._keys = keys
        self._missing_grads = -1 in keys[0]
        if len(self._key_indices) != len(keys[0]):
            self._key_indices = list(range(len(keys[0])))

    def _step_keys(self, params):
        """Where each gradient of `params` (what the groups hold now) is (-1: none), and where
        each parameter's data is: two lists. Keys equal to the last step's mean that its plans
        fit: the same parameters with the same data, gradients present where they were. The
        rest of what a parameter's data is (shape, strides) is compared when a key changed
        (_current_layout)."""
        if self._layout.dtensors:
            return ([-1 if (g := local(p.grad)) is None else g.data_ptr() for p in params],
                    [local_data_ptr(p) for p in params])
        return [-1 if g is None else g.data_ptr() for g in [p.grad for p in params]], [p.data_ptr() for p in params]

    def _same_addresses(self, params):
        """_step_keys(params) == the last step's keys, for the common step (every parameter has
        a gradient, none is a DTensor) in torch's own C++ comparison of data pointers where this
        torch has it (the one its CUDA graph trees use): the only per-tensor work of such a step
        is then reading each .grad (docs/python.md, "Host cost of a step")."""
        keys = self._keys
        if _data_ptrs_equal is None or keys is None or keys[1] is None or len(params) != len(keys[1]) or \
                self._missing_grads or self._layout.dtensors:
            return False
        indices = self._key_indices
        try:
            return _data_ptrs_equal([p.grad for p in params], keys[0], indices) and \
                _data_ptrs_equal(params, keys[1], indices)
        except (RuntimeError, TypeError):  # a gradient gone since (None is no tensor)
            return False

    def _current_layout(self):
        """The layout of what the groups hold now: made anew (and checked as at construction)
        if a parameter was added, removed or replaced, or given new data (`p.data = ...`).
        The steps taken stay in the state, which must fit the parameter (_make_cohorts)."""
        params = [p for g in self.param_groups for p in g["params"]]
        if self._get_layout().holds(params):
            return self._layout
        self._refuse_in_capture("the parameters changed since the last step")
        self._invalidate()
        layout = self._get_layout()
        if self._flat is not None and set(map(id, self._flat.params)) != set(map(id, layout.params)):
            self._flat = None
            raise ValueError("param_groups' parameters changed, and the flat gradients given to use_flat_gradients "
                             "no longer cover exactly this optimizer's parameters; make a FlatGradients over the "
                             "new ones and pass it to use_flat_gradients")
        return layout

    def _check_grads(self, params, grads):
        """Refuses, naming the parameter, a gradient a step cannot take; `p.grad = x` checks
        shape and dtype, but `p.grad.data = x` does not."""
        for i, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise TypeError(f"{type(self).__name__} does not support sparse gradients (params[{i}] has a "
                                f"{g.layout} gradient)")
            shape = local(p).shape
            if g.shape != shape or g.dtype != p.dtype or g.device != local(p).device:
                raise ValueError(f"params[{i}].grad is {g.dtype} of shape {tuple(g.shape)} on {g.device}, expected "
                                 f"{p.dtype} of shape {tuple(shape)} on {local(p).device}, as the parameter")

    def _grad_arrays(self, grads, indices):
        return [grads[i] for i in indices]

    def present_grads(self):
        """The gradients the last prepared step covers, in cohort order (those a compiled
        graph handed the step in progress, if it did)."""
        if self._graph_grads is not None:
            return [self._graph_grads[i] for i in self.present_indices()]
        params = self._get_layout().params
        return [local(params[i].grad) for i in self.present_indices()]

    def present_indices(self):
        """The layout positions of present_grads()'s gradients, in the same order."""
        return [i for c in self._cohorts for i in c.indices]

    def _make_cohorts(self, grads, present):
        self._write_steps_to_state()
        layout = self._get_layout()
        by_step = {}
        for i, p in enumerate(layout.params):  # a state made for other data (p.data = ...) is refused
            if present[i] and self.state.get(p):
                self._check_state(p, self.param_groups[layout.group_of[i]], self.state[p], f"the state of params[{i}]")
        self._init_states([p for i, p in enumerate(layout.params) if present[i] and not self.state[p]])
        for i, p in enumerate(layout.params):
            if present[i]:
                by_step.setdefault((int(self.state[p]["step"]), self._cohort_key(i)), []).append(i)
        self._cohorts = []
        for (step, _), indices in sorted(by_step.items(), key=lambda kv: kv[1][0]):
            counter = torch.full((1,), step + self._counter_offset, dtype=torch.int64, device=layout.device)
            self._cohorts.append(_Cohort(indices, counter, self._make_plan(indices, grads)))
        self._present = present
        self._hyper_key = self._current_hyper_key()
        self._cohort_version += 1
        self._pointer_version += 1

    def _cohort_key(self, index):
        """Parameters with different keys never share a plan (LAMB: the group, whose lr is eta)."""
        return 0

    def _init_states(self, params):
        """Zero state for parameters stepped for the first time, made together (their
        low-bit state from one buffer: StateForm.new_states)."""
        entries = []
        for p in params:
            state = self.state[p]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            entries.append((p, self._moment_names(self._group_of_param(p)), state))
        self._form.new_states(entries)

    def master_params(self):
        """The float32 master weights of float16/bfloat16 parameters, in param_groups order
        (None for a parameter that has not been stepped yet); [] for float32/float64 models.
        The masters themselves, or with master="remainder" copies joined from each
        parameter and its remainder."""
        layout = self._get_layout()
        if not layout.masters:
            return []
        return [float_master(p, self.state[p]) if self.state[p] else None for p in layout.params]

    def _group_of_param(self, p):
        for g in self.param_groups:
            for q in g["params"]:
                if q is p:
                    return g
        raise KeyError("parameter not in this optimizer")

    def _write_steps_to_state(self):
        """Copies each cohort's device counter into its parameters' "step" (synchronous)."""
        if not getattr(self, "_cohorts", None):
            return
        params = self._layout.params
        for c in self._cohorts:
            completed = float(int(c.counter.item()) - self._counter_offset)
            for i in c.indices:
                self.state[params[i]]["step"] = torch.tensor(completed, dtype=torch.float32)

    # -- hyperparameters -------------------------------------------------------

    def _current_hyper_key(self):
        return tuple(tuple(v for k, v in sorted(g.items()) if k not in ("params", "lr")) for g in self.param_groups)

    def _sync_hyperparameters(self):
        """Rewrites the plans' tables if a group's hyperparameters other than lr changed."""
        key = self._current_hyper_key()
        if key != self._hyper_key:
            self._refuse_in_capture("the hyperparameters changed")
            hypers = [self._hyperparameters(g) for g in self.param_groups]
            for c in self._cohorts:
                c.plan.set_hyperparameters(hypers)
            self._hyper_key = key

    def _lr_tensor(self):
        """The per-group learning rates as float32 on the device, rewritten when one changed."""
        lrs = [float(g["lr"]) for g in self.param_groups]
        if lrs != self._lrs:
            self._refuse_in_capture("the learning rates changed")
            for i, lr in enumerate(lrs):
                if not lr >= 0 or lr == float("inf"):
                    raise ValueError(f"param_groups[{i}]['lr'] is {lr}, expected a finite value >= 0")
            device = self._get_layout().device
            if self._lr_device is None or self._lr_device.numel() != len(lrs) or self._lr_device.device != device:
                self._lr_device = torch.empty(len(lrs), dtype=torch.float32, device=device)
                self._lr_scalar = gradkit.DeviceScalar(self._lr_device)
            self._lr_device.copy_(torch.tensor(lrs, dtype=torch.float32), non_blocking=True)
            self._lrs = lrs
        if self._capturing:  # the graph's replays write the rates it was recorded with, not another graph's
            for i, lr in enumerate(lrs):
                self._lr_device[i].fill_(lr)
        return self._lr_scalar

    # -- the step ----------------------------------------------------------------

    def _step_with(self, found_inf=None, grad_divisor=None, check=None, grads=None):
        """Launches every cohort. `check(stream)`, if given, runs first: the fused
        mixed-precision step's gradient check, which writes found_inf and grad_divisor.
        `grads`: _prepare's (a compiled graph's gradients)."""
        stream = stream_handle(self._get_layout().device)
        cohorts = self._prepare(stream, grads)
        if not cohorts:
            return False
        self._sync_hyperparameters()
        if check is not None:
            check(stream)
        self._launch_all(cohorts, stream, found_inf, grad_divisor)
        return True

    def _plan_lists(self, indices, grads):
        """weights, gradients, group indices, the model copy (the float16/bfloat16
        parameters a float32-master update writes; [] otherwise) and the remainders
        (bfloat16 parameters with remainder masters; [] otherwise) of a cohort."""
        params = self._layout.params
        g = self._grad_arrays(grads, indices)
        groups = [self._layout.group_of[i] for i in indices]
        weights = [local(params[i].detach()) for i in indices]
        key = self._form.master_key(params[indices[0]])
        if key == "master_param":
            return self._state_list(indices, key), g, groups, weights, []
        if key == "weight_remainder":
            return weights, g, groups, [], self._state_list(indices, key)
        return weights, g, groups, [], []

    def _absmax_lists(self, indices):
        """The plan's absmax lists (and moment_bits for 4-bit moments); a cohort's
        parameters share their form (_cohort_key)."""
        p = self._layout.params[indices[0]]
        bits = self._form.bits(p)
        if not bits:
            return {}
        lists = {"exp_avg_absmax": self._state_list(indices, self._form.absmax_key(p, "exp_avg")),
                 "exp_avg_sq_absmax": self._state_list(indices, self._form.absmax_key(p, "exp_avg_sq"))}
        if bits == 4:
            lists["moment_bits"] = 4
        return lists

    def _state_list(self, indices, name):
        """A state tensor of each parameter of `indices`, as gradkit reads it (the local shard)."""
        params = self._layout.params
        return [local(self.state[params[i]][name]) for i in indices]


def _check_hyperparameters(lr, betas, eps, weight_decay, where=""):
    """Refuses, with torch's ValueError, an Adam-like group's hyperparameter out of range,
    naming it (`where`: the group, "" for the constructor's arguments). A tensor lr or betas
    must hold one element, as torch's."""
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError(f"{where}lr is a tensor of {lr.numel()} elements, expected one (a tensor lr holds one value)")
    if not float(lr) >= 0.0 or float(lr) == float("inf"):
        raise ValueError(f"{where}lr is {lr}, expected a finite value >= 0")
    if isinstance(betas, (str, bytes)) or len(betas) != 2:
        raise ValueError(f"{where}betas is {betas!r}, expected two values (beta1, beta2)")
    for i, b in enumerate(betas):
        if torch.is_tensor(b) and b.numel() != 1:
            raise ValueError(f"{where}betas[{i}] is a tensor of {b.numel()} elements, expected one")
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"{where}betas[{i}] is {float(b)}, expected a value in [0, 1)")
    if not eps > 0.0:
        raise ValueError(f"{where}eps is {eps}, expected a value > 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"{where}weight_decay is {weight_decay}, expected a value >= 0")
