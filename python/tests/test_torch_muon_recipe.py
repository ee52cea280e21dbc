"""gradkit.torch.Muon's recipe options (Polar Express, its divisor, MuonEq, Muon+,
NorMuon, cautious weight decay) and gradkit.torch.MuonAdamW (nanochat's optimizer)
against the float64 reference written from the papers' formulas
(support/muon_recipe.py), on seeded random inputs; their state, schedules and
refusals; non-finite gradients."""
import copy

import pytest
import torch

import gradkit
import gradkit.torch as gt
import tolerances
from support.muon_recipe import AdamWReference, MuonRecipe

SHAPES = [(40, 24), (24, 40), (32, 32), (3, 16, 24)]  # tall, wide, square, a 3-D stack
POLAR_EXPRESS = [tuple(t) for t in gradkit.polar_express_coefficients]
EVERY_OPTION = dict(ns_coefficients="polar_express", divisor="polar_express", eps=1e-6, equilibrate_rows=True,
                    renormalize=True, beta2=0.9, cautious_weight_decay=True)
OPTIONS = {"plain": {}, "divisor": dict(divisor="polar_express"), "equilibrate_rows": dict(equilibrate_rows=True),
           "renormalize": dict(renormalize=True), "beta2": dict(beta2=0.9),
           "cautious_weight_decay": dict(cautious_weight_decay=True), "every_option": EVERY_OPTION}
DTYPES = [torch.float32, torch.bfloat16]


def reference_options(options):
    """The reference's arguments for gt.Muon's group options."""
    out = {k: options[k] for k in ("divisor", "equilibrate_rows", "renormalize", "beta2", "cautious_weight_decay",
                                   "eps", "ns_steps") if k in options}
    coefficients = options.get("ns_coefficients", (3.4445, -4.775, 2.0315))
    out["triples"] = POLAR_EXPRESS if coefficients == "polar_express" else (
        [coefficients] if len(coefficients) == 3 and not isinstance(coefficients[0], tuple) else coefficients)
    return out


def weights(opt, p):
    """What the step updates: p, or its float32 master (bfloat16 parameters)."""
    state = opt.state[p]
    return state["master_param"] if "master_param" in state else p.detach()


def update_error(got, want, before, result=None):
    """||got - want|| / ||want - before|| (the updates' relative distance), over the elements
    whose reference result is not near 0 where `result` is given (cautious weight decay's
    mask may flip there)."""
    got, want, before = got.double(), want.double(), before.double()
    keep = torch.ones_like(want, dtype=torch.bool) if result is None else \
        result.abs() > 2.0 ** -6 * result.pow(2).mean().sqrt()
    return ((got - want)[keep].norm() / (want - before)[keep].norm()).item()


def run_against_reference(shape, dtype, options, steps=4, seed=0):
    """gt.Muon and the reference, steps from the same weights (gradkit's before each step;
    the reference keeps its own momentum and second moment): the worst update error,
    momentum difference and second-moment error."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape).to(dtype))
    opt = gt.Muon([p], lr=0.02, weight_decay=0.1, **options)
    ref = MuonRecipe(shape, lr=0.02, weight_decay=0.1, **reference_options(options))
    worst = [0.0, 0.0, 0.0]
    for _ in range(steps):
        g = torch.randn(shape).to(dtype)
        p.grad = g.clone()
        before = (weights(opt, p) if opt.state[p] else p.detach().float()).clone()
        want = ref.step(before, g, grad_dtype=dtype)
        opt.step()
        cautious = options.get("cautious_weight_decay", False)
        worst[0] = max(worst[0], update_error(weights(opt, p), want, before, ref.result if cautious else None))
        worst[1] = max(worst[1], (opt.state[p]["momentum_buffer"].double() - ref.buf).abs().max().item())
        if ref.second is not None:
            v = opt.state[p]["second_momentum_buffer"]
            assert v.dtype == torch.float32
            v = v.double().reshape(ref.second.shape)
            worst[2] = max(worst[2], ((v - ref.second).norm() / ref.second.norm()).item())
        if dtype == torch.bfloat16:
            assert torch.equal(p.detach(), weights(opt, p).bfloat16())  # the parameter is its master's rounding
    return worst


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_element_wise_parts_match_the_float64_reference(name, dtype):
    """Each option alone and all together, with the identity iteration (a, b, c) = (1, 0, 0):
    what is left is the element-wise parts (the divisor, MuonEq's row scales, Muon+'s and
    NorMuon's scales of the result, the decay), held to bf16 rounding."""
    options = {**OPTIONS[name], "ns_coefficients": (1.0, 0.0, 0.0), "ns_steps": 1}
    for shape in SHAPES:
        error, momentum, second = run_against_reference(shape, dtype, options)
        assert error <= tolerances.MUON_RECIPE_ELEMENTWISE, (shape, error)
        assert momentum <= 1e-6, (shape, momentum)
        assert second <= tolerances.MUON_RECIPE_SECOND_MOMENT, (shape, second)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["polar_express", "plain", "every_option"])
def test_the_iterations_match_the_float64_reference(name, dtype):
    """Polar Express's five triples in order (alone, and with every other option), and
    torch's triple, through the Newton-Schulz products."""
    options = {"polar_express": dict(ns_coefficients="polar_express"), "plain": {},
               "every_option": EVERY_OPTION}[name]
    for shape in SHAPES:
        error, _, second = run_against_reference(shape, dtype, options)
        assert error <= tolerances.MUON_RECIPE_ITERATION, (shape, error)
        assert second <= tolerances.MUON_RECIPE_ITERATION, (shape, second)


def steps_of(options, shape=(24, 40), steps=3, seed=2):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = gt.Muon([p], lr=0.02, **options)
    for _ in range(steps):
        p.grad = torch.randn(shape)
        opt.step()
    return p.detach()


def test_ns_coefficients_forms():
    """'polar_express' is gradkit.polar_express_coefficients; one triple is a list of one;
    iterations past the last triple repeat it."""
    assert torch.equal(steps_of(dict(ns_coefficients="polar_express")),
                       steps_of(dict(ns_coefficients=POLAR_EXPRESS)))
    assert torch.equal(steps_of(dict(ns_coefficients=(3.0, -3.2, 1.2))),
                       steps_of(dict(ns_coefficients=[(3.0, -3.2, 1.2)])))
    a, b = (3.0, -3.2, 1.2), (2.0, -1.5, 0.5)
    assert torch.equal(steps_of(dict(ns_coefficients=[a, b], ns_steps=4)),
                       steps_of(dict(ns_coefficients=[a, b, b, b], ns_steps=4)))
    assert not torch.equal(steps_of(dict(ns_coefficients=[a, b], ns_steps=4)),
                           steps_of(dict(ns_coefficients=[b, a], ns_steps=4)))


def test_the_recipe_is_off_by_default():
    """The defaults are torch.optim.Muon's step: the options given as their off values
    change no bit."""
    off = dict(ns_coefficients=(3.4445, -4.775, 2.0315), divisor="clamp", equilibrate_rows=False,
               renormalize=False, beta2=None, cautious_weight_decay=False)
    assert torch.equal(steps_of({}), steps_of(off))
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = gt.Muon([p])
    p.grad = torch.randn(8, 8)
    opt.step()
    assert set(opt.state[p]) == {"step", "momentum_buffer"}  # no second moment without beta2


@pytest.mark.parametrize("shape, state_shape", [((40, 24), (40, 1)), ((24, 40), (1, 40)), ((32, 32), (32, 1)),
                                                ((3, 16, 24), (3, 1, 24)), ((3, 24, 16), (3, 24, 1))])
def test_the_second_moment_is_one_value_per_row_or_column(shape, state_shape):
    assert gradkit.muon_second_moment_numel(*((1,) + shape if len(shape) == 2 else shape)) == \
        torch.Size(state_shape).numel()
    p = torch.nn.Parameter(torch.randn(shape))
    opt = gt.Muon([p], lr=0.02, beta2=0.95)
    p.grad = torch.randn(shape)
    opt.step()
    v = opt.state[p]["second_momentum_buffer"]
    assert v.shape == state_shape and v.dtype == torch.float32 and bool((v > 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_a_state_dict_round_trip_continues_bit_for_bit(dtype):
    """Every option on: saved after 3 steps, loaded into a fresh optimizer over the same
    weights, the next 3 steps equal the original's (the second moment float32 for bfloat16
    parameters too, which torch's load_state_dict would round)."""
    torch.manual_seed(3)
    shapes = [(40, 24), (24, 40), (3, 16, 24)]
    a_params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    a, b = (gt.Muon(ps, lr=0.02, weight_decay=0.1, **EVERY_OPTION) for ps in (a_params, b_params))
    grads = [[torch.randn(s).to(dtype) for s in shapes] for _ in range(6)]
    for gs in grads[:3]:
        for p, g in zip(a_params, gs):
            p.grad = g.clone()
        a.step()
    saved = copy.deepcopy(a.state_dict())
    assert saved["state"][0]["second_momentum_buffer"].dtype == torch.float32
    assert saved["param_groups"][0]["ns_coefficients"] == "polar_express" and saved["param_groups"][0]["beta2"] == 0.9
    with torch.no_grad():
        for p, q in zip(b_params, a_params):
            p.copy_(q)
    b.load_state_dict(saved)
    assert b.state[b_params[0]]["second_momentum_buffer"].dtype == torch.float32
    for gs in grads[3:]:
        for ps, opt in ((a_params, a), (b_params, b)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(a_params, b_params):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["second_momentum_buffer"], b.state[q]["second_momentum_buffer"])


def test_a_nanochat_slice_of_the_second_moment_loads():
    """nanochat stacks a group's second moments, (K, rows, 1); one parameter's slice loads
    as its "second_momentum_buffer", and a slice of another shape is refused, naming it."""
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(40, 24))
    opt = gt.Muon([p], lr=0.02, beta2=0.9)
    p.grad = torch.randn(40, 24)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    stacked = torch.rand(2, 40, 1)
    saved["state"][0]["second_momentum_buffer"] = stacked[1].clone()
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[p]["second_momentum_buffer"], stacked[1])
    saved["state"][0]["second_momentum_buffer"] = torch.rand(1, 24)
    with pytest.raises(ValueError, match=r"\['second_momentum_buffer'\].*expected.*shape \(40, 1\)"):
        opt.load_state_dict(saved)


def test_beta2_set_and_cleared_between_steps():
    """Setting a group's beta2 gives its parameters a second moment from zeros (the plans
    are made anew); clearing it steps without, the state kept."""
    torch.manual_seed(5)
    p = torch.nn.Parameter(torch.randn(24, 40))
    opt = gt.Muon([p], lr=0.02)
    grads = [torch.randn(24, 40) for _ in range(3)]
    p.grad = grads[0].clone()
    opt.step()
    opt.param_groups[0]["beta2"] = 0.9
    p.grad = grads[1].clone()
    opt.step()
    v = opt.state[p]["second_momentum_buffer"].clone()
    assert v.shape == (1, 40) and bool((v > 0).all())
    opt.param_groups[0]["beta2"] = None
    p.grad = grads[2].clone()
    opt.step()
    assert torch.equal(opt.state[p]["second_momentum_buffer"], v)


def test_an_lr_schedule_steps_as_lrs_set_by_hand():
    """LambdaLR over a recipe group: the same bits as the group's lr set by hand."""
    def run(schedule):
        torch.manual_seed(6)
        p = torch.nn.Parameter(torch.randn(40, 24))
        opt = gt.Muon([p], lr=0.04, weight_decay=0.1, **EVERY_OPTION)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
        for s in range(4):
            if not schedule:
                opt.param_groups[0]["lr"] = 0.04 / (1 + s)
            p.grad = torch.randn(40, 24)
            opt.step()
            if sched is not None:
                sched.step()
        return p.detach()
    assert torch.equal(run(True), run(False))


BAD_OPTIONS = [
    (dict(ns_coefficients="quintic"), ValueError, r"param_groups\[0\]\['ns_coefficients'\] is 'quintic'"),
    (dict(ns_coefficients=[(1.0, 2.0, 3.0)] * 9), ValueError, r"\['ns_coefficients'\].*1 to 8"),
    (dict(ns_coefficients=[(1.0, 2.0)]), ValueError, r"\['ns_coefficients'\]"),
    (dict(ns_coefficients=[(1.0, float("nan"), 3.0)]), ValueError, r"\['ns_coefficients'\].*finite"),
    (dict(divisor="max"), ValueError, r"param_groups\[0\]\['divisor'\] is 'max'"),
    (dict(equilibrate_rows=1), TypeError, r"param_groups\[0\]\['equilibrate_rows'\] is 1, expected True or False"),
    (dict(renormalize="yes"), TypeError, r"\['renormalize'\]"),
    (dict(cautious_weight_decay=None), TypeError, r"\['cautious_weight_decay'\]"),
    (dict(beta2=1.0), ValueError, r"param_groups\[0\]\['beta2'\] is 1.0, expected None .* \[0, 1\)"),
    (dict(beta2=-0.5), ValueError, r"\['beta2'\]"),
    (dict(beta2="0.9"), ValueError, r"\['beta2'\]"),
    (dict(heads=0), ValueError, r"param_groups\[0\]\['heads'\] is 0, expected None .* int >= 1"),
    (dict(heads=True), ValueError, r"\['heads'\] is True"),
    (dict(heads="4"), ValueError, r"\['heads'\] is '4'"),
    (dict(heads=3), ValueError, r"param_groups\[0\]\['params'\]\[0\] has shape \(8, 8\), whose 8 rows "
                                r"param_groups\[0\]\['heads'\] = 3 does not divide"),
]


@pytest.mark.parametrize("options, error, message", BAD_OPTIONS, ids=[str(o) for o, _, _ in BAD_OPTIONS])
def test_bad_options_are_refused_naming_the_group_and_key(options, error, message):
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(error, match=message):
        gt.Muon([w], **options)
    opt = gt.Muon([{"params": [w]}])
    with pytest.raises(error, match=message.replace("param_groups\\[0\\]", "param_groups\\[1\\]")):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, 8))], **options})
    assert len(opt.param_groups) == 1
    # A group given the option between steps: refused at the next step, nothing written.
    w.grad = torch.randn(8, 8)
    opt.step()
    before = w.detach().clone()
    opt.param_groups[0].update(options)
    with pytest.raises(error, match=message):
        opt.step()
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("options", [{}, EVERY_OPTION], ids=["plain", "every_option"])
@pytest.mark.parametrize("shape", [(32, 24), (2, 24, 40)], ids=["matrix", "stack"])
def test_heads_orthogonalise_each_heads_rows_as_a_stack_does(shape, options):
    """heads=H steps each matrix's H blocks of rows / H rows as Muon steps them stacked
    (a 3-D parameter of the heads): the same bits, the second moment per head."""
    heads = 4
    torch.manual_seed(9)
    w = torch.randn(shape)
    per_head = w.reshape(-1, shape[-2] // heads, shape[-1])
    p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(per_head.clone())
    opts = [gt.Muon([{"params": [p], "heads": heads}], lr=0.02, weight_decay=0.1, **options),
            gt.Muon([q], lr=0.02, weight_decay=0.1, **options)]
    for _ in range(3):
        g = torch.randn(shape)
        p.grad, q.grad = g.clone(), g.reshape(per_head.shape).clone()
        for opt in opts:
            opt.step()
        assert torch.equal(p.detach().reshape(per_head.shape), q.detach())
    assert opts[0].state[p]["momentum_buffer"].shape == p.shape
    if "beta2" in options:
        assert torch.equal(opts[0].state[p]["second_momentum_buffer"], opts[1].state[q]["second_momentum_buffer"])


# -- MuonAdamW: nanochat's optimizer ----------------------------------------------------


class TinyNanochat(torch.nn.Module):
    """nanochat's GPT's parameter kinds, small: an embedding and a value embedding
    (bfloat16 where `bf16`, as nanochat holds them), attention- and MLP-shaped matrices,
    a head, per-layer scalars."""

    def __init__(self, vocab=64, dim=32, layers=2, bf16=False):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.ve = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"q": torch.nn.Linear(dim, dim, bias=False), "proj": torch.nn.Linear(dim, dim, bias=False),
                                 "fc": torch.nn.Linear(dim, 4 * dim, bias=False),
                                 "down": torch.nn.Linear(4 * dim, dim, bias=False)}) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.lambdas = torch.nn.Parameter(torch.ones(layers))
        if bf16:
            self.wte.to(torch.bfloat16)
            self.ve.to(torch.bfloat16)

    def forward(self, idx, targets):
        x = self.wte(idx).float() + self.ve(idx).float()
        for i, b in enumerate(self.blocks):
            x = x + self.lambdas[i] * b["proj"](torch.tanh(b["q"](x)))
            x = x + b["down"](torch.relu(b["fc"](x)))
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def param_groups(self, matrix_lr=0.02, weight_decay=0.2):
        """nanochat's setup_optimizer's groups (its lrs and betas), one Muon group a shape."""
        matrices = [p for b in self.blocks for p in b.parameters()]
        groups = [dict(kind="adamw", params=[self.head.weight], lr=0.004, betas=(0.8, 0.96), eps=1e-10,
                       weight_decay=0.01),
                  dict(kind="adamw", params=[self.wte.weight], lr=0.2, betas=(0.8, 0.995), eps=1e-10,
                       weight_decay=0.001),
                  dict(kind="adamw", params=[self.ve.weight], lr=0.1, betas=(0.8, 0.995), eps=1e-10, weight_decay=0.01),
                  dict(kind="adamw", params=[self.lambdas], lr=0.005, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.05)]
        for shape in sorted({p.shape for p in matrices}):
            groups.append(dict(kind="muon", params=[p for p in matrices if p.shape == shape], lr=matrix_lr,
                               momentum=0.95, ns_steps=5, beta2=0.9, weight_decay=weight_decay))
        return groups


def nanochat_reference(group, p):
    """The float64 reference of nanochat's step for a parameter of `group`."""
    if group["kind"] == "adamw":
        return AdamWReference(p.shape, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                              weight_decay=group["weight_decay"])
    return MuonRecipe(p.shape, lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
                      triples=POLAR_EXPRESS, ns_steps=min(group["ns_steps"], 5), eps=1e-6, divisor="polar_express",
                      equilibrate_rows=True, renormalize=True, beta2=group["beta2"], cautious_weight_decay=True)


def batches(steps, vocab=64, seed=9):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (4, 16), generator=g), torch.randint(0, vocab, (4, 16), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16-embeddings"])
def test_muon_adamw_steps_as_the_float64_reference_of_nanochats(bf16):
    """A few training steps of a small nanochat-shaped model: each step's update of every
    parameter from the same weights as the reference of nanochat's step (its Muon groups'
    recipe, its AdamW groups' AdamW). bfloat16 embeddings step their float32 masters."""
    torch.manual_seed(7)
    model = TinyNanochat(bf16=bf16)
    opt = gt.MuonAdamW(model.param_groups())
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    refs = {p: nanochat_reference(g, p) for g in opt.param_groups for p in g["params"]}
    for x, y in batches(4):
        model(x, y).backward()
        before = {p: (weights(opt, p) if opt.state[p] else p.detach().float()).clone() for p in refs}
        want = {p: (r.step(before[p], p.grad, grad_dtype=p.grad.dtype) if isinstance(r, MuonRecipe)
                    else r.step(before[p], p.grad)) for p, r in refs.items()}
        opt.step()
        opt.zero_grad()
        for g in opt.param_groups:
            for p in g["params"]:
                if g["kind"] == "muon":
                    error = update_error(weights(opt, p), want[p], before[p], refs[p].result)
                    assert error <= tolerances.MUON_RECIPE_ITERATION, (tuple(p.shape), error)
                else:
                    rtol, atol = tolerances.REFERENCE_STEP[__import__("numpy").float32]
                    torch.testing.assert_close(weights(opt, p).double(), want[p], rtol=rtol, atol=atol)
    state = opt.state[model.blocks[0]["fc"].weight]
    assert state["second_momentum_buffer"].shape == (128, 1) and state["momentum_buffer"].shape == (128, 32)
    assert set(opt.state[model.head.weight]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert opt.param_groups[0]["initial_lr"] == 0.004 and "use_muon" not in opt.param_groups[0]


def test_muon_adamw_state_dict_round_trip_and_schedule():
    """Saved after 2 steps and loaded into a fresh MuonAdamW over the same weights, the next
    steps equal the original's bit for bit, with a LambdaLR on its groups (their initial_lr)
    stepping both."""
    torch.manual_seed(8)
    a_model = TinyNanochat(bf16=True)
    b_model = copy.deepcopy(a_model)
    a, b = gt.MuonAdamW(a_model.param_groups()), gt.MuonAdamW(b_model.param_groups())
    data = batches(5)
    for x, y in data[:2]:
        a_model(x, y).backward()
        a.step()
        a.zero_grad()
    saved = copy.deepcopy(a.state_dict())
    b_model.load_state_dict(a_model.state_dict())
    b.load_state_dict(saved)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 - 0.2 * s) for o in (a, b)]
    for x, y in data[2:]:
        for model, opt in ((a_model, a), (b_model, b)):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        for s in schedules:
            s.step()
    for (n, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(p, q), n
    assert a.param_groups[-1]["lr"] == pytest.approx(0.02 * 0.4) and a.param_groups[-1]["initial_lr"] == 0.02


def nanochat_groups(**changes):
    model = TinyNanochat()
    groups = model.param_groups()
    kind = changes.pop("kind_of", None)
    index = 0 if kind == "adamw" else len(groups) - 1
    for k, v in changes.items():
        if v is KeyError:
            del groups[index][k]
        else:
            groups[index][k] = v
    return groups, index


@pytest.mark.parametrize("changes, error, message", [
    (dict(kind="sgd"), ValueError, r"\['kind'\] is 'sgd', expected 'adamw' or 'muon'"),
    (dict(beta2=KeyError), ValueError, r" \(kind 'muon'\) has no 'beta2'"),
    (dict(kind_of="adamw", betas=KeyError), ValueError, r" \(kind 'adamw'\) has no 'betas'"),
    (dict(beta2=1.0), ValueError, r"\['beta2'\] is 1.0, expected a value in \[0, 1\)"),
    (dict(beta2=None), ValueError, r"\['beta2'\] is None"),
    (dict(ns_steps=0), ValueError, r"\['ns_steps'\] is 0"),
    (dict(momentum=1.5), ValueError, r"\['momentum'\] is 1.5"),
    (dict(kind_of="adamw", betas=(0.9,)), ValueError, r"\['betas'\]"),
    (dict(kind_of="adamw", eps=0.0), ValueError, r"\['eps'\] is 0.0"),
    (dict(lr=-1.0), ValueError, r"\['lr'\] is -1.0"),
], ids=["unknown-kind", "missing-beta2", "missing-betas", "beta2-1", "beta2-None", "ns_steps-0", "momentum",
        "betas", "eps", "lr"])
def test_muon_adamw_refuses_bad_groups_naming_them(changes, error, message):
    groups, index = nanochat_groups(**changes)
    with pytest.raises(error, match=rf"param_groups\[{index}\]" + message):
        gt.MuonAdamW(groups)


def test_muon_adamw_refuses_a_bad_value_set_between_steps():
    """A schedule that writes a bad value (beta2 1.0) is refused at the next step, naming it;
    nothing is written."""
    model = TinyNanochat()
    opt = gt.MuonAdamW(model.param_groups())
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    before = copy.deepcopy(model.state_dict())
    opt.param_groups[-1]["beta2"] = 1.0
    with pytest.raises(ValueError, match=rf"param_groups\[{len(opt.param_groups) - 1}\]\['beta2'\] is 1.0"):
        opt.step()
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


def test_a_non_finite_gradient_makes_its_matrix_nan_and_found_inf_skips():
    """As torch.optim.Muon: an Inf or NaN in a matrix's gradient makes that matrix's weights
    (and its second moment) NaN, and leaves the other matrices of its group, orthogonalised
    in the same batch, as a step without it leaves them. AmpStep's found_inf skips the whole
    step: weights and state as they were."""
    torch.manual_seed(10)
    models = [TinyNanochat(), None]
    models[1] = copy.deepcopy(models[0])
    opts = [gt.MuonAdamW(m.param_groups()) for m in models]
    x, y = batches(1)[0]
    for m in models:
        m(x, y).backward()
    bad = models[0].blocks[0]["fc"].weight
    bad.grad[3, 5] = float("nan")
    clean = models[1].blocks[0]["fc"].weight
    clean.grad[3, 5] = 0.0  # the other matrices' numbers do not depend on this element
    for o in opts:
        o.step()
    assert bool(bad.isnan().all()) and bool(opts[0].state[bad]["second_momentum_buffer"].isnan().all())
    same_batch = models[0].blocks[1]["fc"].weight
    assert torch.isfinite(same_batch).all()
    assert torch.equal(same_batch, models[1].blocks[1]["fc"].weight)

    model = TinyNanochat()
    opt = gt.MuonAdamW(model.param_groups())
    amp = gt.AmpStep(opt, init_scale=2.0 ** 8)
    model(x, y).backward()
    amp.step()  # a first step, so that the state exists
    opt.zero_grad()
    model(x, y).backward()
    model.blocks[0]["q"].weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])
    amp.step()
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[0][n]), n
    for k, s in opt.state_dict()["state"].items():
        for name, t in s.items():
            assert torch.equal(t, before[1][k][name]), (k, name)


def test_amp_step_over_float32_and_bfloat16_parameters():
    """AmpStep over MuonAdamW with bfloat16 embeddings (a gradient check per dtype, their
    partials combined): gradients of a loss scaled by 2^8 step as the unscaled ones bit for
    bit (a power of two), and an Inf in a bfloat16 gradient skips the step."""
    torch.manual_seed(11)
    scaled = TinyNanochat(bf16=True)
    plain = copy.deepcopy(scaled)
    opt, ref = gt.MuonAdamW(scaled.param_groups()), gt.MuonAdamW(plain.param_groups())
    amp = gt.AmpStep(opt, init_scale=2.0 ** 8, growth_interval=1000)
    for x, y in batches(2):
        (scaled(x, y) * 2.0 ** 8).backward()
        plain(x, y).backward()
        amp.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for (n, p), q in zip(scaled.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), n
    x, y = batches(1, seed=12)[0]
    scaled(x, y).backward()
    scaled.wte.weight.grad[1, 2] = float("inf")
    before = copy.deepcopy(scaled.state_dict())
    amp.step()
    for n, t in scaled.state_dict().items():
        assert torch.equal(t, before[n]), n
    assert amp.get_scale() < 2.0 ** 8
