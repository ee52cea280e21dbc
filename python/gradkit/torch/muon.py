"""Muon for the hidden matrices and gradkit's fused AdamW for the rest, in one
torch.optim.Optimizer (docs/python.md, "Muon").

A param group with "use_muon": True (the default) takes torch.optim.Muon's step:
its parameters must be 2-D matrices or 3-D stacks of matrices (mixture-of-experts
weights, orthogonalised per matrix over their trailing two dimensions). A group
with "use_muon": False takes AdamW (decoupled weight decay; its "betas" and
"adamw_eps"), as the Muon papers do for embeddings, the output head and 1-D
tensors; muon_param_groups(model) makes that split. Every number is gradkit's:
MuonPlan (same-shape matrices orthogonalised together, bf16 products with f32
accumulation) and AdamPlan, one cohort each, as gradkit.torch's other optimizers
plan theirs.

DTensor parameters sharded on any mesh (FSDP2's rows, tensor parallelism's rows
and columns, FSDP x TP, expert stacks) take MuonShardedPlan (_muon_shards): each
matrix has an owner rank (balanced by Newton-Schulz FLOPs; a rank holding a whole
matrix keeps it); the step is the momentum pass on each rank's piece, all-to-alls
of the updates' bf16 pieces to the owners over the ranks holding one copy, the
owners' Newton-Schulz on whole matrices, all-to-alls back, and the weight update
on the pieces: the unsharded step's numbers. The momentum stays sharded like the
parameters. The matrices go in buckets (exchange_buckets), each exchanged on
torch's communication stream while the owners orthogonalise another.

A group's "heads" (None by default) orthogonalises each matrix per block of
rows / heads rows (an attention projection's heads), as a stack of those blocks.

bfloat16 parameters keep float32 masters ("master_param"), as gradkit.torch.AdamW's
do: Muon steps the masters and each parameter becomes its master's rounding (one
gradkit.AccumulatePlan launch per cohort), so a bfloat16 model follows the float32
model's trajectory as its gradients allow; the AdamW groups' masters are AdamW's.
"""
import math
import numbers
import operator

import torch

import gradkit
from gradkit.torch._device import stream_handle
from gradkit.torch._dtensor import is_dtensor, local
from gradkit.torch._muon_shards import ShardedMuon, Wrapping, exchange_key
from gradkit.torch._param_groups import adam_hyperparameters
from gradkit.torch._planned import _PlannedOptimizer
from gradkit.torch._state_forms import StateForm
from gradkit.torch.optim import AdamW

_ADJUST_LR = {None: gradkit.MuonLrAdjust.original, "original": gradkit.MuonLrAdjust.original,
              "match_rms_adamw": gradkit.MuonLrAdjust.match_rms_adamw}
_MOMENTS = ("float32", "bfloat16")
_DIVISORS = {"clamp": gradkit.MuonDivisor.clamp, "polar_express": gradkit.MuonDivisor.polar_express}
_MAX_TRIPLES = 8  # gradkit.MuonHyperparameters holds 1 to 8 per-iteration triples
_FLAGS = ("equilibrate_rows", "renormalize", "cautious_weight_decay")
# NorMuon's second moment in a parameter's state (nanochat's key): float32, one value per
# row (rows >= cols) or per column of each matrix.
SECOND_MOMENT = "second_momentum_buffer"


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def ns_triples(value):
    """A group's "ns_coefficients" as gradkit takes them (a list of (a, b, c) floats, one per
    Newton-Schulz iteration, the last repeated), or None where it is none of the forms Muon
    takes: one triple (torch's), a list of 1 to 8 triples, or "polar_express"."""
    if isinstance(value, str):
        return [tuple(t) for t in gradkit.polar_express_coefficients] if value == "polar_express" else None
    try:
        items = list(value)
    except TypeError:
        return None
    if len(items) == 3 and all(_is_real(x) for x in items):
        items = [items]
    if not 1 <= len(items) <= _MAX_TRIPLES:
        return None
    out = []
    for t in items:
        try:
            t = tuple(t) if not isinstance(t, str) else ()
        except TypeError:
            return None
        if len(t) != 3 or not all(_is_real(x) and math.isfinite(x) for x in t):
            return None
        out.append(tuple(float(x) for x in t))
    return out


def second_moment_shape(p, heads=None):
    """The shape of p's NorMuon second moment: (rows, 1) where rows >= cols, else (1, cols),
    of each matrix Muon orthogonalises (with `heads`, each head's rows / heads rows),
    after their batch dimension (a 3-D stack's, and the heads'); muon_second_moment_numel
    elements."""
    batch, rows, cols = _matrix_shape(p, heads)
    tail = (rows, 1) if rows >= cols else (1, cols)
    return ((batch,) if p.ndim == 3 or _per_head(heads) else ()) + tail


def _bucket_count(n):
    """exchange_buckets as an int in [1, 2^31) (numpy integers too), else a ValueError naming it."""
    try:
        count = operator.index(n) if not isinstance(n, bool) else None
    except TypeError:
        count = None
    if count is None or not 1 <= count < 2 ** 31:
        raise ValueError(f"exchange_buckets is {n!r}, expected an int in [1, 2^31)")
    return count


def _as_given(ns_coefficients):
    """ns_coefficients as a group holds it: a name as it is, a sequence as a tuple (a
    generator read once), anything else as it is for the group's check to name."""
    if isinstance(ns_coefficients, str):
        return ns_coefficients
    try:
        return tuple(tuple(t) if isinstance(t, (list, tuple)) else t for t in ns_coefficients)
    except TypeError:
        return ns_coefficients


def _param_name(group, j):
    names = group.get("param_names")
    return repr(names[j]) if names is not None and j < len(names) else None


def _per_head(heads):
    return heads is not None and heads != 1


def _matrix_shape(p, heads=None):
    """(batch, rows, cols) of the matrices Muon orthogonalises in a 2-D matrix or a 3-D
    stack: each matrix, or with `heads` each one's blocks of rows / heads rows."""
    batch, rows, cols = (1, *p.shape) if p.ndim == 2 else tuple(p.shape)
    if _per_head(heads):
        return (batch * heads, rows // heads, cols)
    return (batch, rows, cols)


def _check_group(group, index):
    """Refuses, naming the group and the parameter, what its step cannot take."""
    where = f"param_groups[{index}]"
    check_options(group, where)
    if group["use_muon"]:
        check_params(group, where, muon=True, result_scales=[(k, group[k]) for k in ("renormalize", "beta2")
                                                             if group[k] not in (False, None)])
    else:
        check_params(group, where, muon=False)


def check_options(group, where):
    """Refuses, naming the group and the key, a gt.Muon group's option out of range (at
    add_param_group, and when a step finds a group's options changed)."""
    if not float(group["lr"]) >= 0.0 or float(group["lr"]) == float("inf"):
        raise ValueError(f"{where}['lr'] is {group['lr']}, expected a finite value >= 0")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"{where}['weight_decay'] is {group['weight_decay']}, expected a value >= 0")
    if not group["use_muon"]:
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{where}['betas'] is {betas}, expected two values in [0, 1)")
        if not group["adamw_eps"] > 0.0:
            raise ValueError(f"{where}['adamw_eps'] is {group['adamw_eps']}, expected a value > 0")
        return
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"{where}['momentum'] is {group['momentum']}, expected a value in [0, 1)")
    if ns_triples(group["ns_coefficients"]) is None:
        raise ValueError(f"{where}['ns_coefficients'] is {group['ns_coefficients']!r}, expected three finite values "
                         f"(a, b, c), a list of 1 to {_MAX_TRIPLES} such triples (one per Newton-Schulz iteration, the "
                         "last repeated) or 'polar_express'")
    if not 1 <= group["ns_steps"] < 100:
        raise ValueError(f"{where}['ns_steps'] is {group['ns_steps']}, expected a count in [1, 100)")
    if not group["eps"] > 0.0:
        raise ValueError(f"{where}['eps'] is {group['eps']}, expected a value > 0")
    if group["adjust_lr_fn"] not in _ADJUST_LR:
        raise ValueError(f"{where}['adjust_lr_fn'] is {group['adjust_lr_fn']!r}, expected None, 'original' or "
                         "'match_rms_adamw'")
    if group["divisor"] not in _DIVISORS:
        raise ValueError(f"{where}['divisor'] is {group['divisor']!r}, expected 'clamp' (torch's max(||X||, eps)) or "
                         "'polar_express' (1.01 ||X|| + eps)")
    for key in _FLAGS:
        if not isinstance(group[key], bool):
            raise TypeError(f"{where}[{key!r}] is {group[key]!r}, expected True or False")
    check_beta2(group["beta2"], f"{where}['beta2']", optional=True)
    check_heads(group.get("heads"), f"{where}['heads']")


def check_heads(heads, what):
    """Refuses a group's "heads" other than None or a count >= 1, naming `what`."""
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        raise ValueError(f"{what} is {heads!r}, expected None (whole matrices) or an int >= 1 (per head: each "
                         "matrix's rows in that many blocks)")


def check_heads_divide(group, where):
    """Refuses, naming the group and the parameter, a Muon group's matrix whose rows the
    group's "heads" does not divide."""
    heads = group.get("heads")
    if not _per_head(heads):
        return
    for j, p in enumerate(group["params"]):
        if p.ndim in (2, 3) and p.shape[-2] % heads:
            name = _param_name(group, j)
            raise ValueError(f"{where}['params'][{j}]" + (f" ({name})" if name else "") +
                             f" has shape {tuple(p.shape)}, whose {p.shape[-2]} rows {where}['heads'] = {heads} "
                             "does not divide; per-head Muon splits each matrix's rows into heads of equal rows")


def check_beta2(beta2, what, optional):
    """Refuses a NorMuon beta2 outside [0, 1) (None too, unless optional), naming `what`."""
    if beta2 is None and optional:
        return
    if not (_is_real(beta2) and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{what} is {beta2!r}, expected " + ("None (no second moment) or " if optional else "") +
                         "a value in [0, 1) (NorMuon's second moment)")


def check_params(group, where, muon, result_scales=()):
    """Refuses, naming the group and the parameter, a parameter the group's step cannot take:
    a dtype other than float32 and bfloat16; in a Muon group, a tensor neither 2-D nor 3-D,
    rows that "heads" does not divide, and a sharded DTensor where `result_scales` ((key,
    value) of the group's options that scale the orthogonalised result: Muon+, NorMuon)
    is not empty, which the sharded step does not take. Any Shard placements on any mesh
    are taken (Partial ones are refused with the layout)."""
    for j, p in enumerate(group["params"]):
        name = _param_name(group, j)
        what = f"{where}['params'][{j}]" + (f" ({name})" if name else "")
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{what} has dtype {p.dtype}; gradkit.torch.Muon takes float32 and bfloat16 parameters "
                            "(bfloat16 ones with float32 masters)")
        if not muon:
            continue
        if p.ndim not in (2, 3):
            raise ValueError(f"{what} has shape {tuple(p.shape)}; Muon takes 2-D matrices and 3-D stacks of them. "
                             "Put 1-D tensors, embeddings and the output head in a group with 'use_muon': False "
                             "(AdamW), as gradkit.torch.muon_param_groups(model) does")
        if exchange_key(p) is not None and result_scales:
            key, value = result_scales[0]
            raise ValueError(f"{where}[{key!r}] is {value!r} and {what} is a sharded DTensor (placements "
                             f"{tuple(p.placements)}); the sharded Muon step takes ns_coefficients, divisor, "
                             "equilibrate_rows and cautious_weight_decay, not the scales of the orthogonalised "
                             "result (renormalize: Muon+; beta2: NorMuon), which need whole matrices where the "
                             "pieces are updated")
    if muon:
        check_heads_divide(group, where)


class Muon(AdamW):
    """torch.optim.Muon's step (same arguments and defaults) for the groups with
    "use_muon": True, and AdamW for the groups with "use_muon": False (lr and
    weight_decay as given in the group, else this optimizer's; "betas" default
    adamw_betas and "adamw_eps" default adamw_eps). moments="bfloat16" stores the
    momentum buffers and AdamW's moments in bfloat16 (half the bytes).

    The state is torch.optim.Muon's ("momentum_buffer", plus a "step" count) and
    torch.optim.AdamW's; state_dict() loads into either, and their state dicts load
    here. Parameters are float32 or bfloat16; bfloat16 ones keep float32 masters
    ("master_param"), which the step updates, each parameter then its master's
    rounding.

    The recipe's parts are group options, off by default (docs/ops.md,
    "muon_step", gives each one's formula): ns_coefficients one (a, b, c) triple
    (torch's), a list of 1 to 8 (one per Newton-Schulz iteration, the last repeated)
    or "polar_express" (Polar Express's five); divisor "clamp" (torch's
    max(||X||, eps)) or "polar_express" (1.01 ||X|| + eps); equilibrate_rows
    (MuonEq); renormalize (Muon+); beta2 None, or NorMuon's second moment's EMA
    weight in [0, 1), its state "second_momentum_buffer" (float32, (rows, 1) where
    rows >= cols, else (1, cols), after a 3-D stack's batch dimension);
    cautious_weight_decay.

    Parameters may be float32 and bfloat16 together (nanochat's embeddings are
    bfloat16), each dtype in plans of its own.

    A group's "heads" (None, or a count that divides each matrix's rows)
    orthogonalises each head's rows / heads rows as a matrix of its own (q, k and v
    projections per head).

    Over sharded DTensors (any Shard placements on any mesh), the matrices'
    exchanges go in up to exchange_buckets buckets (whole shape classes, balanced by
    Newton-Schulz FLOPs), each sent while the one before is orthogonalised; the
    numbers do not depend on it. The sharded step refuses renormalize and beta2."""

    _decay = gradkit.WeightDecay.decoupled
    _mixed_dtypes = True
    _copied_attributes = AdamW._copied_attributes + ("_exchange_buckets",)

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 divisor="clamp", equilibrate_rows=False, renormalize=False, beta2=None, cautious_weight_decay=False,
                 heads=None, adamw_betas=(0.9, 0.95), adamw_eps=1e-8, moments="float32", exchange_buckets=2):
        if moments not in _MOMENTS:
            raise ValueError(f"moments is {moments!r}, expected 'float32' or 'bfloat16' (Muon has no 8- or 4-bit "
                             "momentum)")
        self._exchange_buckets = _bucket_count(exchange_buckets)
        self._form = StateForm(moments)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=_as_given(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, divisor=divisor, equilibrate_rows=equilibrate_rows,
                        renormalize=renormalize, beta2=beta2, cautious_weight_decay=cautious_weight_decay,
                        heads=heads, use_muon=True, betas=tuple(adamw_betas), adamw_eps=adamw_eps, amsgrad=False, maximize=False)
        _PlannedOptimizer.__init__(self, params, defaults)  # add_param_group checks each group

    def _check_group(self, index):
        """Refuses a group Muon's step cannot take (add_param_group, construction)."""
        _check_group(self.param_groups[index], index)

    def _check_options(self):
        """Refuses, naming it, a group option out of range that a group was given since it
        was added (a step re-reads the options when they changed; the parameters were
        checked when the layout was made, all but the heads they must split into)."""
        for i, g in enumerate(self.param_groups):
            where = f"param_groups[{i}]"
            check_options(g, where)
            if self._group_is_muon(g):
                check_heads_divide(g, where)

    # -- what each group takes ----------------------------------------------------

    def _group_is_muon(self, group):
        return group["use_muon"]

    def _has_second_moment(self, group):
        """Whether a Muon group keeps NorMuon's second moment."""
        return group["beta2"] is not None

    def _moment_names(self, group):
        return ("momentum_buffer",) if self._group_is_muon(group) else ("exp_avg", "exp_avg_sq")

    def _is_muon(self, index):
        return self._group_is_muon(self.param_groups[self._layout.group_of[index]])

    def _cohort_key(self, index):
        """Muon and AdamW parameters, Muon groups with and without a second moment (a plan
        takes one per parameter or none), float32 and bfloat16 parameters (a plan takes
        one dtype) and Muon parameters exchanged over different ranks (or none) never
        share a plan."""
        group = self.param_groups[self._layout.group_of[index]]
        p = self._layout.params[index]
        if self._group_is_muon(group):
            return "muon", self._has_second_moment(group), p.dtype, exchange_key(p)
        return "adamw", p.dtype

    def _muon_hyperparameters(self, g):
        """A group's gradkit.MuonHyperparameters (an AdamW group's: the defaults, which its
        tensors, in no Muon plan, never use)."""
        if not self._group_is_muon(g):
            return gradkit.MuonHyperparameters()
        beta2 = g["beta2"]
        return gradkit.MuonHyperparameters(
            lr=float(g["lr"]), weight_decay=g["weight_decay"], momentum=g["momentum"], nesterov=g["nesterov"],
            ns_coefficients=ns_triples(g["ns_coefficients"]), eps=g["eps"], ns_steps=g["ns_steps"],
            adjust_lr=_ADJUST_LR[g["adjust_lr_fn"]], divisor=_DIVISORS[g["divisor"]],
            equilibrate_rows=g["equilibrate_rows"], renormalize=g["renormalize"], second_moment=beta2 is not None,
            beta2=0.95 if beta2 is None else float(beta2), cautious_weight_decay=g["cautious_weight_decay"])

    def _result_scales(self, group):
        """The (key, value) of a Muon group's options that scale the orthogonalised result
        (Muon+, NorMuon), which the sharded step does not take."""
        return [(k, group[k]) for k in ("renormalize", "beta2") if group[k] not in (False, None)]

    def _hyperparameters(self, g):
        return adam_hyperparameters({**g, "eps": g["adamw_eps"]}, self._decay)

    # -- NorMuon's second moment ------------------------------------------------------

    def _init_plans(self):
        super()._init_plans()
        self._structure = None  # which groups' plans hold a second moment (_plan_structure)

    def _plan_structure(self):
        """Per group, whether its Muon plan takes second-moment tensors and its heads (None:
        an AdamW group); the plans are made anew when it changes (a group's beta2 or heads
        set or cleared)."""
        return tuple((self._has_second_moment(g), g.get("heads")) if self._group_is_muon(g) else None
                     for g in self.param_groups)

    def _prepare(self, stream, grads=None):
        if self._cohorts and self._structure != self._plan_structure():
            self._invalidate()
        return super()._prepare(stream, grads)

    def _make_cohorts(self, grads, present):
        self._check_options()
        super()._make_cohorts(grads, present)
        self._structure = self._plan_structure()

    def _second_moment(self, p, heads):
        """p's second moment as the plan takes it (float32, contiguous, second_moment_shape):
        zeros where the state has none (a first step, a state saved without one), converted
        where a loaded one is of another dtype."""
        state = self.state[p]
        v = state.get(SECOND_MOMENT)
        if v is None:
            v = torch.zeros(second_moment_shape(p, heads), dtype=torch.float32, device=p.device)
        elif v.dtype != torch.float32 or v.device != p.device or not v.is_contiguous():
            v = v.to(device=p.device, dtype=torch.float32).contiguous()
        state[SECOND_MOMENT] = v
        return v

    def _check_state(self, p, group, state, where):
        """As the other optimizers', and a Muon parameter's second moment, where the state
        holds one, floating point of second_moment_shape(p)."""
        super()._check_state(p, group, state, where)
        v = state.get(SECOND_MOMENT)
        if v is None or not self._group_is_muon(group):
            return
        want = second_moment_shape(p, group.get("heads"))
        if not torch.is_tensor(v) or not v.is_floating_point() or tuple(v.shape) != want:
            got = f"{v.dtype} of shape {tuple(v.shape)}" if torch.is_tensor(v) else type(v).__name__
            raise ValueError(f"{where}[{SECOND_MOMENT!r}] is {got}, expected a floating-point tensor of shape "
                             f"{want} (one value per row where rows >= cols, else per column, of "
                             f"the parameter of shape {tuple(p.shape)})")

    def _refuse_scales_over_shards(self):
        """A group whose options the sharded step does not take, over sharded DTensors:
        a ValueError naming the group's option."""
        if not self._get_layout().dtensors:
            return
        for i, g in enumerate(self.param_groups):
            if g["params"] and self._group_is_muon(g):
                check_params(g, f"param_groups[{i}]", muon=True, result_scales=self._result_scales(g))

    # -- plans ------------------------------------------------------------------------

    def _make_plan(self, indices, grads):
        if not self._is_muon(indices[0]):
            return super()._make_plan(indices, grads)
        params = self._layout.params
        weights = [local(params[i].detach()) for i in indices]
        masters = self._state_list(indices, "master_param") if params[indices[0]].dtype == torch.bfloat16 else None
        lists = (weights if masters is None else masters, self._grad_arrays(grads, indices),
                 self._state_list(indices, "momentum_buffer"))
        hyper = [self._muon_hyperparameters(g) for g in self.param_groups]
        groups = [self._layout.group_of[i] for i in indices]
        heads = [self.param_groups[g].get("heads") for g in groups]
        shapes = [_matrix_shape(params[i], h) for i, h in zip(indices, heads)]
        if exchange_key(params[indices[0]]) is None:  # the cohort's parameters are whole on this rank
            second = self.param_groups[groups[0]]
            second = [self._second_moment(params[i], h) for i, h in zip(indices, heads)] \
                if self._has_second_moment(second) else []
            plan = gradkit.MuonPlan(*lists, shapes, hyper, groups, hold_grads=False, second_moment=second)
        else:
            self._refuse_scales_over_shards()
            plan = ShardedMuon([params[i] for i in indices], lists, shapes, heads, hyper, groups,
                               self._exchange_buckets)
        return plan if masters is None else _MasterMuon(plan, weights, masters)

    def _current_hyper_key(self):
        """AdamW's key (its plans read lr from the device), and the Muon groups' learning
        rates, which Muon's plans hold in their table."""
        return super()._current_hyper_key(), tuple(float(g["lr"]) for g in self.param_groups
                                                    if self._group_is_muon(g))

    def _sync_hyperparameters(self):
        """A new Muon lr (a schedule: every step) rewrites the Muon plans' tables in order on
        the step's stream, without waiting for the device; the AdamW plans' only when their
        own hyperparameters changed."""
        key = self._current_hyper_key()
        if key == self._hyper_key:
            return
        self._refuse_in_capture("the hyperparameters changed")
        self._check_options()
        self._refuse_scales_over_shards()
        adam_changed = self._hyper_key is None or key[0] != self._hyper_key[0]
        stream = stream_handle(self._get_layout().device)
        muon = [self._muon_hyperparameters(g) for g in self.param_groups]
        adam = [self._hyperparameters(g) for g in self.param_groups] if adam_changed else None
        for c in self._cohorts:
            if isinstance(c.plan, _MUON_PLANS):
                c.plan.set_hyperparameters(muon, stream=stream)
            elif adam_changed:
                c.plan.set_hyperparameters(adam)
        self._hyper_key = key

    def _launch_all(self, cohorts, stream, found_inf, grad_divisor):
        adamw = [c for c in cohorts if not isinstance(c.plan, _MUON_PLANS)]
        if adamw:
            super()._launch_all(adamw, stream, found_inf, grad_divisor)
        for c in cohorts:
            if isinstance(c.plan, _MUON_PLANS):
                gradkit.advance_step(c.counter_scalar, skip=found_inf, stream=stream)
                c.plan.step(found_inf=found_inf, grad_scale_device=grad_divisor, stream=stream)

    def _checked_for_loading(self, state_dict):
        """As the other optimizers' (a group key the saved groups lack keeps this optimizer's
        value: torch.optim.Muon's and AdamW's groups lack "use_muon", "betas", "adamw_eps",
        ...), taking torch.optim.Muon's state, which counts no steps."""
        state = {k: dict(v) if isinstance(v, dict) else v for k, v in state_dict.get("state", {}).items()}
        for s in state.values():
            if isinstance(s, dict) and "momentum_buffer" in s and "step" not in s:
                s["step"] = torch.tensor(0.0)
        return super()._checked_for_loading({**state_dict, "state": state})


def muon_param_groups(model, *, exclude=(), **adamw_group):
    """The split the Muon papers make of `model`'s trainable parameters: two param
    groups, the 2-D and 3-D weights with "use_muon": True, and with "use_muon": False
    (AdamW) the 1-D tensors, the embeddings (nn.Embedding weights, tied copies
    included), the output head (an nn.Linear whose out_features is an embedding's
    num_embeddings: a vocabulary) and whatever `exclude` names (modules, parameters
    or parameter names). `adamw_group` adds keys to the AdamW group (lr, betas, ...)."""
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    vocab = {m.num_embeddings for m in embeddings}
    to_adamw = {id(m.weight) for m in embeddings}
    to_adamw |= {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features in vocab}
    named = dict(model.named_parameters())
    for x in exclude:
        if isinstance(x, torch.nn.Module):
            to_adamw |= {id(p) for p in x.parameters()}
        elif isinstance(x, str):
            if x not in named:
                raise ValueError(f"exclude names {x!r}, which is not one of the model's parameters")
            to_adamw.add(id(named[x]))
        else:
            to_adamw.add(id(x))
    muon, adamw = [], []
    for p in model.parameters():  # each tensor once (tied weights appear once)
        if p.requires_grad:
            (muon if p.ndim in (2, 3) and id(p) not in to_adamw else adamw).append(p)
    groups = [{"params": muon, "use_muon": True}]
    if adamw:
        groups.append({"params": adamw, "use_muon": False, **adamw_group})
    return groups


class _MasterMuon(Wrapping):
    """A Muon cohort of bfloat16 parameters: its plan (MuonPlan or ShardedMuon) steps
    their float32 masters, then the parameters become the masters' rounding (to nearest
    even), one gradkit.AccumulatePlan launch. A skipped step (found_inf) leaves the
    masters, so the copy writes the parameters they already are."""

    def __init__(self, plan, params, masters):
        self.plan = plan
        self._copy = gradkit.AccumulatePlan(params, masters)

    def step(self, found_inf=None, grad_scale_device=None, stream=0):
        self.plan.step(found_inf=found_inf, grad_scale_device=grad_scale_device, stream=stream)
        self._copy.accumulate_v2(overwrite=True, stream=stream)


_MUON_PLANS = (gradkit.MuonPlan, ShardedMuon, _MasterMuon)
