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

FSDP2's DTensor parameters (rows sharded, Shard(0)) take MuonShardedPlan: each
matrix has an owner rank (balanced by Newton-Schulz FLOPs); the step is the
momentum pass on each rank's rows, all-to-alls of the updates' bf16 rows to
the owners over the shards' process group, the owners' Newton-Schulz on whole
matrices, all-to-alls back, and the weight update on the rows: the unsharded
step's numbers. The momentum stays sharded like the parameters. The matrices
go in buckets (exchange_buckets), each exchanged on torch's communication
stream while the owners orthogonalise another.

bfloat16 parameters keep float32 masters ("master_param"), as gradkit.torch.AdamW's
do: Muon steps the masters and each parameter becomes its master's rounding (one
gradkit.AccumulatePlan launch per cohort), so a bfloat16 model follows the float32
model's trajectory as its gradients allow; the AdamW groups' masters are AdamW's.
"""
import operator

import torch

import gradkit
from gradkit.torch._device import stream_handle
from gradkit.torch._dtensor import is_dtensor, local
from gradkit.torch._param_groups import adam_hyperparameters
from gradkit.torch._planned import _PlannedOptimizer
from gradkit.torch._state_forms import StateForm
from gradkit.torch.optim import AdamW

_ADJUST_LR = {None: gradkit.MuonLrAdjust.original, "original": gradkit.MuonLrAdjust.original,
              "match_rms_adamw": gradkit.MuonLrAdjust.match_rms_adamw}
_MOMENTS = ("float32", "bfloat16")


def _bucket_count(n):
    """exchange_buckets as an int in [1, 2^31) (numpy integers too), else a ValueError naming it."""
    try:
        count = operator.index(n) if not isinstance(n, bool) else None
    except TypeError:
        count = None
    if count is None or not 1 <= count < 2 ** 31:
        raise ValueError(f"exchange_buckets is {n!r}, expected an int in [1, 2^31)")
    return count


def _param_name(group, j):
    names = group.get("param_names")
    return repr(names[j]) if names is not None and j < len(names) else None


def _matrix_shape(p):
    """(batch, rows, cols) of a 2-D matrix or a 3-D stack of matrices."""
    if p.ndim == 2:
        return (1, p.shape[0], p.shape[1])
    return tuple(p.shape)


def _check_group(group, index):
    """Refuses, naming the group and the parameter, what its step cannot take."""
    where = f"param_groups[{index}]"
    if not float(group["lr"]) >= 0.0 or float(group["lr"]) == float("inf"):
        raise ValueError(f"{where}['lr'] is {group['lr']}, expected a finite value >= 0")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"{where}['weight_decay'] is {group['weight_decay']}, expected a value >= 0")
    for j, p in enumerate(group["params"]):
        if p.dtype not in (torch.float32, torch.bfloat16):
            name = _param_name(group, j)
            raise TypeError(f"{where}['params'][{j}]" + (f" ({name})" if name else "") +
                            f" has dtype {p.dtype}; gradkit.torch.Muon takes float32 and bfloat16 parameters "
                            "(bfloat16 ones with float32 masters)")
    if not group["use_muon"]:
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{where}['betas'] is {betas}, expected two values in [0, 1)")
        if not group["adamw_eps"] > 0.0:
            raise ValueError(f"{where}['adamw_eps'] is {group['adamw_eps']}, expected a value > 0")
        return
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"{where}['momentum'] is {group['momentum']}, expected a value in [0, 1)")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(f"{where}['ns_coefficients'] is {group['ns_coefficients']}, expected three values (a, b, c)")
    if not 1 <= group["ns_steps"] < 100:
        raise ValueError(f"{where}['ns_steps'] is {group['ns_steps']}, expected a count in [1, 100)")
    if not group["eps"] > 0.0:
        raise ValueError(f"{where}['eps'] is {group['eps']}, expected a value > 0")
    if group["adjust_lr_fn"] not in _ADJUST_LR:
        raise ValueError(f"{where}['adjust_lr_fn'] is {group['adjust_lr_fn']!r}, expected None, 'original' or "
                         "'match_rms_adamw'")
    for j, p in enumerate(group["params"]):
        name = _param_name(group, j)
        what = f"{where}['params'][{j}]" + (f" ({name})" if name else "")
        if p.ndim not in (2, 3):
            raise ValueError(f"{what} has shape {tuple(p.shape)}; Muon takes 2-D matrices and 3-D stacks of them. "
                             "Put 1-D tensors, embeddings and the output head in a group with 'use_muon': False "
                             "(AdamW), as gradkit.torch.muon_param_groups(model) does")
        if is_dtensor(p):
            cut = [pl for pl in p.placements if pl.is_shard()]
            if any(not pl.is_shard(0) or type(pl).__name__ != "Shard" for pl in cut):
                raise ValueError(f"{what} is a DTensor with placements {tuple(p.placements)}; Muon takes DTensors "
                                 "sharded by rows (Shard(0), FSDP2's default) or replicated: each owner rank "
                                 "gathers a matrix's rows")


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

    Over DTensors sharded by rows, the matrices' exchanges go in up to
    exchange_buckets buckets (whole shape classes, balanced by Newton-Schulz FLOPs),
    each sent while the one before is orthogonalised; the numbers do not depend on
    it."""

    _decay = gradkit.WeightDecay.decoupled
    _copied_attributes = AdamW._copied_attributes + ("_exchange_buckets",)

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 adamw_betas=(0.9, 0.95), adamw_eps=1e-8, moments="float32", exchange_buckets=2):
        if moments not in _MOMENTS:
            raise ValueError(f"moments is {moments!r}, expected 'float32' or 'bfloat16' (Muon has no 8- or 4-bit "
                             "momentum)")
        self._exchange_buckets = _bucket_count(exchange_buckets)
        self._form = StateForm(moments)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        use_muon=True, betas=tuple(adamw_betas), adamw_eps=adamw_eps, amsgrad=False, maximize=False)
        _PlannedOptimizer.__init__(self, params, defaults)  # add_param_group checks each group

    def _check_group(self, index):
        """Refuses a group Muon's step cannot take (add_param_group, construction)."""
        _check_group(self.param_groups[index], index)

    # -- what each group takes ----------------------------------------------------

    def _moment_names(self, group):
        return ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")

    def _is_muon(self, index):
        return self.param_groups[self._layout.group_of[index]]["use_muon"]

    def _cohort_key(self, index):
        return "muon" if self._is_muon(index) else "adamw"

    def _muon_hyperparameters(self, g):
        a, b, c = g["ns_coefficients"]
        return gradkit.MuonHyperparameters(lr=float(g["lr"]), weight_decay=g["weight_decay"], momentum=g["momentum"],
                                           nesterov=g["nesterov"], ns_a=a, ns_b=b, ns_c=c, eps=g["eps"],
                                           ns_steps=g["ns_steps"], adjust_lr=_ADJUST_LR[g["adjust_lr_fn"]])

    def _hyperparameters(self, g):
        return adam_hyperparameters({**g, "eps": g["adamw_eps"]}, self._decay)

    # -- plans ------------------------------------------------------------------------

    def _make_plan(self, indices, grads):
        if not self._is_muon(indices[0]):
            return super()._make_plan(indices, grads)
        params = self._layout.params
        weights = [local(params[i].detach()) for i in indices]
        masters = self._state_list(indices, "master_param") if params[indices[0]].dtype == torch.bfloat16 else None
        lists = (weights if masters is None else masters, self._grad_arrays(grads, indices),
                 self._state_list(indices, "momentum_buffer"), [_matrix_shape(params[i]) for i in indices])
        hyper = [self._muon_hyperparameters(g) for g in self.param_groups]
        groups = [self._layout.group_of[i] for i in indices]
        shards = self._layout.shard_group()
        if shards is None:
            plan = gradkit.MuonPlan(*lists, hyper, groups, hold_grads=False)
        else:
            plan = _ShardedMuon(shards, [params[i] for i in indices], lists, hyper, groups, self._exchange_buckets)
        return plan if masters is None else _MasterMuon(plan, weights, masters)

    def _current_hyper_key(self):
        """AdamW's key (its plans read lr from the device), and the Muon groups' learning
        rates, which Muon's plans hold in their table."""
        return super()._current_hyper_key(), tuple(float(g["lr"]) for g in self.param_groups if g["use_muon"])

    def _sync_hyperparameters(self):
        """A new Muon lr (a schedule: every step) rewrites the Muon plans' tables in order on
        the step's stream, without waiting for the device; the AdamW plans' only when their
        own hyperparameters changed."""
        key = self._current_hyper_key()
        if key == self._hyper_key:
            return
        self._refuse_in_capture("the hyperparameters changed")
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


def _row_splits(p, ranks):
    """torch.chunk's split of p's dim 0 over `ranks` (DTensor's and FSDP2's Shard(0)),
    in rows of the (batch * rows, cols) matrix list: ranks + 1 boundaries."""
    slices = p.shape[0]
    rows_per_slice = 1 if p.ndim == 2 else p.shape[1]
    each = -(-slices // ranks)
    return [min(r * each, slices) * rows_per_slice for r in range(ranks + 1)]


class _Wrapping:
    """A cohort's plan behind another step: the gradients and hyperparameters go to
    the gradkit plan it wraps (self.plan)."""

    def set_grads(self, grads, hold_grads=False, stream=0):
        self.plan.set_grads(grads, hold_grads=hold_grads, stream=stream)

    def set_hyperparameters(self, hyperparameters, stream=None):
        self.plan.set_hyperparameters(hyperparameters, stream=stream)


class _ShardedMuon(_Wrapping):
    """A Muon cohort of row-sharded DTensors: MuonShardedPlan's three parts with the
    all-to-alls between them on the shards' process group, bucket by bucket. Each
    bucket's exchange is issued as soon as its momentum is written; its products start
    on the plan's side stream once it has arrived, while the next bucket's momentum
    and exchange run; its rows go back and are updated as soon as its products are
    done, while the next bucket's products run. The exchange buffers are the plan's;
    they travel as bytes (the bf16 values' bits: every backend moves uint8, gloo
    included)."""

    def __init__(self, group, params, lists, hyper, groups, buckets):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        splits = [_row_splits(p, ranks) for p in params]
        for p, s, shard in zip(params, splits, lists[0]):
            held = (s[rank + 1] - s[rank]) * p.shape[-1]
            if shard.numel() != held:
                raise ValueError(f"a DTensor of shape {tuple(p.shape)} holds {shard.numel()} elements on rank {rank}, "
                                 f"expected torch.chunk's rows {s[rank]} to {s[rank + 1]} ({held}); Muon takes "
                                 "Shard(0) as DTensor and FSDP2 split it")
        self.plan = gradkit.MuonShardedPlan(*lists, splits, rank, ranks, hyper, groups, hold_grads=False,
                                            buckets=buckets)
        each = range(self.plan.num_buckets)
        self.shard = [torch.from_dlpack(self.plan.shard_buffer(k)).view(torch.uint8) for k in each]
        self.owner = [torch.from_dlpack(self.plan.owner_buffer(k)).view(torch.uint8) for k in each]
        self.shard_counts = [[2 * n for n in self.plan.shard_counts(k)] for k in each]
        self.owner_counts = [[2 * n for n in self.plan.owner_counts(k)] for k in each]

    def exchange(self, k, back=False):
        """Bucket k's all-to-all: the rows to their owners, or (back) the owners' results
        to the rows' ranks (over NCCL the current stream waits for it, not the host)."""
        if back:
            return self._dist.all_to_all_single(self.shard[k], self.owner[k], self.shard_counts[k],
                                                self.owner_counts[k], group=self.group)
        return self._dist.all_to_all_single(self.owner[k], self.shard[k], self.owner_counts[k], self.shard_counts[k],
                                            group=self.group)

    def step(self, found_inf=None, grad_scale_device=None, stream=0):
        # Bucket by bucket: its momentum, its exchange, then its products on the plan's side stream, so
        # that the next bucket's momentum and exchange run while they do; then
        # bucket by bucket its products joined, its rows back and their update,
        # which runs while the next bucket's products still do. A plan of one
        # bucket has nothing to overlap: its products run on the stream (the
        # side-stream path costs a 1-bucket step time of its own; measured:
        # bench/log/2026-11-26.md, "Muon's exchanges in buckets"). muon_sharded_step
        # (C++) runs the same order over a gradkit communicator.
        plan, buckets = self.plan, range(len(self.shard))
        beside = len(buckets) > 1
        for k in buckets:
            plan.momentum(k, found_inf=found_inf, grad_scale_device=grad_scale_device, stream=stream)
            self.exchange(k)
            if beside:
                plan.orthogonalize_beside(k, found_inf=found_inf, stream=stream)
            else:
                plan.orthogonalize(k, found_inf=found_inf, stream=stream)
        for k in buckets:
            if beside:
                plan.join(k, stream=stream)
            self.exchange(k, back=True)
            plan.update(k, found_inf=found_inf, stream=stream)


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


class _MasterMuon(_Wrapping):
    """A Muon cohort of bfloat16 parameters: its plan (MuonPlan or _ShardedMuon) steps
    their float32 masters, then the parameters become the masters' rounding (to nearest
    even), one gradkit.AccumulatePlan launch. A skipped step (found_inf) leaves the
    masters, so the copy writes the parameters they already are."""

    def __init__(self, plan, params, masters):
        self.plan = plan
        self._copy = gradkit.AccumulatePlan(params, masters)

    def step(self, found_inf=None, grad_scale_device=None, stream=0):
        self.plan.step(found_inf=found_inf, grad_scale_device=grad_scale_device, stream=stream)
        self._copy.accumulate_v2(overwrite=True, stream=stream)


_MUON_PLANS = (gradkit.MuonPlan, _ShardedMuon, _MasterMuon)
