"""nanochat's MuonAdamW as a gradkit.torch optimizer: its param groups as they are,
its step, gradkit's plans (docs/python.md, "nanochat's MuonAdamW").

A group with kind="muon" (lr, momentum, ns_steps, beta2, weight_decay) takes the
recipe nanochat runs: Nesterov momentum, MuonEq's row equilibration, Polar Express's
coefficients with the input divided by 1.01 ||X|| + 1e-6, Muon+'s renormalisation,
NorMuon's second moment with the group's beta2, and cautious weight decay, with the
learning rate scaled by sqrt(max(1, rows / cols)). A group with kind="adamw" (lr,
betas, eps, weight_decay) takes AdamW (decoupled decay, bias correction). Other keys
(initial_lr, ...) stay in the groups. It is gradkit.torch.Muon with each group's
options read from those keys: state dicts, LR schedulers, bfloat16 masters, hooks and
torch.compile are Muon's.
"""
import gradkit
from gradkit.torch._param_groups import adam_hyperparameters
from gradkit.torch._planned import _PlannedOptimizer
from gradkit.torch._state_forms import StateForm
from gradkit.torch.muon import _MOMENTS, Muon, _is_real, check_beta2, check_heads, check_heads_divide, check_params

# The keys each kind of group must hold (nanochat's setup_optimizer gives them all).
GROUP_KEYS = {"adamw": ("lr", "betas", "eps", "weight_decay"),
              "muon": ("lr", "momentum", "ns_steps", "beta2", "weight_decay")}
# nanochat's Polar Express: its five triples, at most five iterations (a group's ns_steps
# past five runs five, as nanochat's slice of the triples does), and the divisor's eps.
POLAR_EXPRESS_STEPS = 5
POLAR_EXPRESS_EPS = 1e-6


def check_group_options(group, where):
    """Refuses, naming the group and the key, a nanochat group that is no MuonAdamW group: an
    unknown kind, a missing key, a value out of range."""
    kind = group.get("kind")
    if kind not in GROUP_KEYS:
        raise ValueError(f"{where}['kind'] is {kind!r}, expected 'adamw' or 'muon' (nanochat's MuonAdamW groups)")
    missing = [k for k in GROUP_KEYS[kind] if k not in group]
    if missing:
        raise ValueError(f"{where} (kind {kind!r}) has no {missing[0]!r}; a {kind!r} group holds "
                         f"{', '.join(map(repr, GROUP_KEYS[kind]))}")
    lr, decay = group["lr"], group["weight_decay"]
    if not _is_real(lr) or not 0.0 <= float(lr) < float("inf"):
        raise ValueError(f"{where}['lr'] is {lr!r}, expected a finite value >= 0")
    if not _is_real(decay) or not 0.0 <= float(decay) < float("inf"):
        raise ValueError(f"{where}['weight_decay'] is {decay!r}, expected a finite value >= 0")
    if kind == "adamw":
        betas = group["betas"]
        if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2 or \
                not all(_is_real(b) and 0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"{where}['betas'] is {betas!r}, expected two values in [0, 1)")
        if not _is_real(group["eps"]) or not float(group["eps"]) > 0.0:
            raise ValueError(f"{where}['eps'] is {group['eps']!r}, expected a value > 0")
        return
    if not _is_real(group["momentum"]) or not 0.0 <= float(group["momentum"]) < 1.0:
        raise ValueError(f"{where}['momentum'] is {group['momentum']!r}, expected a value in [0, 1)")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
        raise ValueError(f"{where}['ns_steps'] is {steps!r}, expected an int in [1, 100)")
    check_beta2(group["beta2"], f"{where}['beta2']", optional=False)
    check_heads(group.get("heads"), f"{where}['heads']")


class MuonAdamW(Muon):
    """nanochat's MuonAdamW (nanochat/optim.py) over gradkit's plans: the same param
    groups (dicts with kind "muon" or "adamw" and their keys) and the same step (the
    module's text). Parameters may be float32 and bfloat16 together, as nanochat holds
    them; bfloat16 ones keep float32 masters ("master_param"), where nanochat steps
    them in bfloat16. The state per parameter is "momentum_buffer" and
    "second_momentum_buffer" (float32, (rows, 1) for rows >= cols, else (1, cols): one
    parameter's slice of nanochat's stacked buffers) in Muon groups, AdamW's
    "exp_avg" and "exp_avg_sq" in AdamW groups, and a "step" count. moments="bfloat16"
    stores the momentum buffers and AdamW's moments in bfloat16."""

    def __init__(self, param_groups, *, moments="float32"):
        if moments not in _MOMENTS:
            raise ValueError(f"moments is {moments!r}, expected 'float32' or 'bfloat16'")
        self._exchange_buckets = 1  # no sharded step: NorMuon and Muon+ need whole matrices
        self._form = StateForm(moments)
        _PlannedOptimizer.__init__(self, param_groups, {})  # add_param_group checks each group

    def _check_group(self, index):
        group, where = self.param_groups[index], f"param_groups[{index}]"
        check_group_options(group, where)
        muon = group["kind"] == "muon"
        check_params(group, where, muon=muon, result_scales=[("beta2", group["beta2"])] if muon else ())

    def _check_options(self):
        for i, g in enumerate(self.param_groups):
            where = f"param_groups[{i}]"
            check_group_options(g, where)
            if g["kind"] == "muon":
                check_heads_divide(g, where)

    def _loaded_group(self, group):
        """A loaded or unpickled group keeps nanochat's keys (no AdamW key is added)."""

    # -- each group's options, from nanochat's keys ------------------------------------

    def _group_is_muon(self, group):
        return group["kind"] == "muon"

    def _has_second_moment(self, group):
        return True

    def _result_scales(self, group):
        return [("beta2", group["beta2"])]

    def _muon_hyperparameters(self, g):
        if g["kind"] != "muon":
            return gradkit.MuonHyperparameters()
        return gradkit.MuonHyperparameters(
            lr=float(g["lr"]), weight_decay=float(g["weight_decay"]), momentum=float(g["momentum"]), nesterov=True,
            ns_coefficients=list(gradkit.polar_express_coefficients), eps=POLAR_EXPRESS_EPS,
            ns_steps=min(g["ns_steps"], POLAR_EXPRESS_STEPS), adjust_lr=gradkit.MuonLrAdjust.original,
            divisor=gradkit.MuonDivisor.polar_express, equilibrate_rows=True, renormalize=True, second_moment=True,
            beta2=float(g["beta2"]), cautious_weight_decay=True)

    def _hyperparameters(self, g):
        if g["kind"] != "adamw":
            return gradkit.AdamHyperparameters()
        adamw = dict(lr=g["lr"], betas=tuple(g["betas"]), eps=float(g["eps"]), weight_decay=float(g["weight_decay"]),
                     amsgrad=False, maximize=False)
        return adam_hyperparameters(adamw, self._decay)


__all__ = ["MuonAdamW"]
