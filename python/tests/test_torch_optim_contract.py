"""gradkit.torch's optimizers held to torch.optim.Optimizer's contract as real code uses
it: parameters given new data (`p.data = ...`), param groups edited, state dicts of other
optimizers and of older torch, torch's hooks, deepcopy and pickle, tensor learning rates,
and bad input refused with a named error before anything is written. Where torch has the
behaviour, the test compares with torch; elsewhere with the same optimizer driven the way
whose result is known (an in-place edit instead of a replaced tensor, a run without the
detour)."""
import copy
import math
import pickle

import pytest

torch = pytest.importorskip("torch")
import gradkit.torch as gt  # noqa: E402
from tolerances import TORCH_100_STEPS, TRAINING_LOSS  # noqa: E402

SHAPES = [(16, 8), (8, 16), (24, 8)]  # matrices, so that Muon takes every configuration

# Muon with every part of the recipe on (NorMuon's second moment in the state too).
MUON_RECIPE = dict(ns_coefficients="polar_express", divisor="polar_express", eps=1e-6, equilibrate_rows=True,
                   renormalize=True, beta2=0.9, cautious_weight_decay=True)

# name: (class, constructor arguments, parameter dtype)
CONFIGS = {
    "AdamW": (gt.AdamW, {}, torch.float32),
    "Adam": (gt.Adam, {"weight_decay": 0.1}, torch.float32),
    "Lamb": (gt.Lamb, {"weight_decay": 0.01}, torch.float32),
    "Muon": (gt.Muon, {}, torch.float32),
    "AdamW-bf16-moments": (gt.AdamW, {"moments": "bfloat16"}, torch.float32),
    "AdamW-int8": (gt.AdamW, {"moments": "int8", "min_8bit_size": 0}, torch.float32),
    "AdamW-int4": (gt.AdamW, {"moments": "int4", "min_4bit_size": 0}, torch.float32),
    "Lamb-int8": (gt.Lamb, {"moments": "int8", "min_8bit_size": 0}, torch.float32),
    "AdamW-bf16-f32-master": (gt.AdamW, {}, torch.bfloat16),
    "AdamW-bf16-remainder": (gt.AdamW, {"master": "remainder"}, torch.bfloat16),
    "Muon-bf16": (gt.Muon, {}, torch.bfloat16),
    "Muon-recipe": (gt.Muon, MUON_RECIPE, torch.float32),
    "Muon-recipe-bf16": (gt.Muon, MUON_RECIPE, torch.bfloat16),
}
every_config = pytest.mark.parametrize("config", list(CONFIGS))
has_load_hooks = pytest.mark.skipif(not hasattr(torch.optim.Optimizer, "register_load_state_dict_post_hook"),
                                    reason="torch's state_dict hooks need torch 2.0 or later")
has_decoupled_adam = pytest.mark.skipif(
    "decoupled_weight_decay" not in torch.optim.Adam.__init__.__code__.co_varnames,
    reason="torch.optim.Adam's decoupled_weight_decay needs torch 2.6 or later")


def make_params(dtype=torch.float32, seed=0, shapes=SHAPES, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device, dtype)) for s in shapes]


def gradients(steps, dtype=torch.float32, shapes=SHAPES, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=g) * 0.1).to(device, dtype) for s in shapes] for _ in range(steps)]


def build(config, params):
    cls, kwargs, _ = CONFIGS[config]
    return cls(params, lr=1e-2, **kwargs)


def step_with(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()


def snapshot(opt, params):
    """The parameters and every tensor of the optimizer's state (its step counts as
    state_dict() writes them), copied."""
    state = copy.deepcopy(opt.state_dict()["state"])
    return [p.detach().clone() for p in params], {k: s for k, s in state.items() if isinstance(s, dict)}


def assert_unchanged(opt, params, before):
    weights, state = before
    assert all(torch.equal(a, p.detach()) for a, p in zip(weights, params))
    now = snapshot(opt, params)[1]
    assert now.keys() == state.keys()
    for key in state:
        assert now[key].keys() == state[key].keys()
        for n, v in state[key].items():
            assert torch.equal(now[key][n], v) if torch.is_tensor(v) else now[key][n] == v


def assert_equal_weights(a_params, b_params):
    for a, b in zip(a_params, b_params):
        assert torch.equal(a.detach(), b.detach()), (a - b).abs().max()


# -- parameters given new data ---------------------------------------------------------

@every_config
def test_data_replaced_between_steps_is_followed(device, config):
    """Weight clipping written as `p.data = torch.clamp(p.data, ...)` (a new tensor) steps
    exactly as the same clipping done in place."""
    dtype = CONFIGS[config][2]
    replaced, in_place = make_params(dtype, device=device), make_params(dtype, device=device)
    a, b = build(config, replaced), build(config, in_place)
    for grads in gradients(6, dtype, device=device):
        step_with(a, replaced, grads)
        step_with(b, in_place, grads)
        for p, q in zip(replaced, in_place):
            p.data = torch.clamp(p.data, -0.3, 0.3)
            with torch.no_grad():
                q.clamp_(-0.3, 0.3)
    assert_equal_weights(replaced, in_place)
    assert not torch.equal(replaced[0].detach(), make_params(dtype, device=device)[0].clamp(-0.3, 0.3))  # it trained


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_weight_clipping_through_data_trains_as_torch(name):
    """The WGAN-style clip on a real model: gradkit's losses are torch.optim's."""
    torch.manual_seed(0)
    ours = torch.nn.Linear(20, 3)
    theirs = copy.deepcopy(ours)
    x, y = torch.randn(256, 20), torch.randint(0, 3, (256,))
    losses = []
    for model, cls in ((ours, getattr(gt, name)), (theirs, getattr(torch.optim, name))):
        opt = cls(model.parameters(), lr=1e-2)
        run = []
        for _ in range(40):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            for p in model.parameters():
                p.data = torch.clamp(p.data, -0.5, 0.5)
            run.append(loss.item())
        losses.append(run)
    assert losses[0][-1] < 0.95 * losses[0][0]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=TRAINING_LOSS[0],
                               atol=TRAINING_LOSS[1])


@every_config
def test_data_of_another_layout_is_refused_before_writing(device, config):
    """A transposed view of the same memory, or data of another shape under an existing
    state, is refused at the next step, naming the parameter; nothing is written."""
    dtype = CONFIGS[config][2]
    params = [torch.nn.Parameter(torch.randn(8, 8).to(device, dtype)), *make_params(dtype, device=device)]
    opt = build(config, params)
    grads = [torch.full(p.shape, 0.01, dtype=dtype, device=device) for p in params]
    step_with(opt, params, grads)
    params[0].data = params[0].data.t()
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"params\[0\] is not contiguous"):
        step_with(opt, params, [g.t() if i == 0 else g for i, g in enumerate(grads)])
    assert_unchanged(opt, params, before)
    params[0].data = params[0].data.t().contiguous()
    params[1].data = torch.zeros(8, 8, dtype=dtype, device=device)  # was (16, 8)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"the state of params\[1\].*shape"):
        step_with(opt, params, [torch.zeros(p.shape, dtype=dtype, device=device) for p in params])
    assert_unchanged(opt, params, before)


def test_a_step_over_meta_parameters_is_refused_naming_the_device():
    """Deferred initialisation: an optimizer may be made over meta parameters (torch's may),
    but a step over them, which torch.optim makes a silent no-op, is refused: they have no
    data (model.to_empty makes new parameters, for a new optimizer)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, device="meta"), torch.nn.Tanh(),
                                torch.nn.Linear(16, 2, device="meta"))
    for cls in (gt.AdamW, gt.Lamb):
        opt = cls(model.parameters(), lr=1e-2)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with pytest.raises(RuntimeError, match="meta device"):
            opt.step()
        assert opt.state_dict()["state"] == {}


# -- param groups edited -------------------------------------------------------------

@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_parameters_appended_and_removed_are_followed_as_torch(name):
    ours, theirs = make_params(), make_params()
    extra_ours, extra_theirs = make_params(seed=5)[2], make_params(seed=5)[2]
    a, b = getattr(gt, name)(ours[:2], lr=1e-2), getattr(torch.optim, name)(theirs[:2], lr=1e-2)
    grads = gradients(6)
    for s, step_grads in enumerate(grads):
        if s == 2:  # a parameter appended to the group, as torch honours it
            a.param_groups[0]["params"].append(extra_ours)
            b.param_groups[0]["params"].append(extra_theirs)
        if s == 4:  # one removed: no longer stepped
            a.param_groups[0]["params"].remove(ours[0])
            b.param_groups[0]["params"].remove(theirs[0])
        for ps, opt, extra in ((ours, a, extra_ours), (theirs, b, extra_theirs)):
            for p, g in zip(ps[:2] + [extra], step_grads):
                p.grad = g.clone()
            opt.step()
    for x, y in zip(ours[:2] + [extra_ours], theirs[:2] + [extra_theirs]):
        torch.testing.assert_close(x, y, rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])
    assert not torch.equal(extra_ours.detach(), make_params(seed=5)[2])


@every_config
def test_a_refused_group_is_not_added(config):
    dtype = CONFIGS[config][2]
    params = make_params(dtype)
    opt = build(config, params[:2])
    bad = torch.nn.Parameter(torch.randn(8, 16).to(dtype).t())  # not contiguous
    with pytest.raises(ValueError, match=r"params\[2\] is not contiguous"):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [params[2]]})
    step_with(opt, params, gradients(1, dtype)[0])
    assert len(opt.state) == 3


# -- gradients ------------------------------------------------------------------------

@every_config
def test_gradient_of_another_shape_is_refused_before_writing(device, config):
    """`p.grad.data = x` skips torch's own shape check; the step makes it."""
    dtype = CONFIGS[config][2]
    params = make_params(dtype, device=device)
    opt = build(config, params)
    grads = gradients(2, dtype, device=device)
    step_with(opt, params, grads[0])
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    params[0].grad.data = torch.zeros(8, 16, dtype=dtype, device=device)  # the same count, another shape
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=r"params\[0\]\.grad .*shape \(8, 16\).*expected.*\(16, 8\)"):
        opt.step()
    assert_unchanged(opt, params, before)


# -- state dicts ---------------------------------------------------------------------

@every_config
def test_a_state_dict_round_trip_continues_bit_for_bit(device, config):
    dtype = CONFIGS[config][2]
    a_params, b_params = make_params(dtype, device=device), make_params(dtype, device=device)
    a, b = build(config, a_params), build(config, b_params)
    grads = gradients(6, dtype, device=device)
    for step_grads in grads[:3]:
        step_with(a, a_params, step_grads)
    saved = copy.deepcopy(a.state_dict())
    with torch.no_grad():
        for p, q in zip(b_params, a_params):
            p.copy_(q)
    b.load_state_dict(saved)
    for step_grads in grads[3:]:
        step_with(a, a_params, step_grads)
        step_with(b, b_params, step_grads)
    assert_equal_weights(a_params, b_params)


@pytest.mark.parametrize("step", [-5, torch.tensor(-1.0), math.nan, math.inf, 1e30, 2.5, torch.ones(2), "3"],
                         ids=["-5", "tensor(-1)", "nan", "inf", "1e30", "2.5", "two-elements", "str"])
@pytest.mark.parametrize("config", ["AdamW", "Lamb", "Muon", "AdamW-int8"])
def test_a_bad_step_count_is_refused_at_loading(config, step):
    dtype = CONFIGS[config][2]
    params = make_params(dtype)
    opt = build(config, params)
    step_with(opt, params, gradients(1, dtype)[0])
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["step"] = step
    before = snapshot(opt, params)
    with pytest.raises((ValueError, TypeError), match=r"state_dict\['state'\]\[1\]\['step'\]"):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)
    step_with(opt, params, gradients(1, dtype)[0])  # still steps


@pytest.mark.parametrize("missing", ["maximize", "foreach", "capturable", "differentiable", "fused", "amsgrad",
                                     "decoupled_weight_decay"])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_a_checkpoint_of_an_older_torch_loads(name, missing):
    """A saved group without a newer key (torch < 1.12 saved no "maximize") loads, the key
    keeping this optimizer's value, and steps as torch.optim does on the same dict."""
    ours, theirs = make_params(), make_params()
    source = getattr(torch.optim, name)(make_params(), lr=1e-2)
    step_with(source, [p for g in source.param_groups for p in g["params"]], gradients(1)[0])
    saved = copy.deepcopy(source.state_dict())
    for group in saved["param_groups"]:
        group.pop(missing, None)
    a, b = getattr(gt, name)(ours, lr=1e-2), getattr(torch.optim, name)(theirs, lr=1e-2)
    a.load_state_dict(copy.deepcopy(saved))
    b.load_state_dict(copy.deepcopy(saved))
    for step_grads in gradients(3, seed=2):
        step_with(a, ours, step_grads)
        step_with(b, theirs, step_grads)
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])


@has_decoupled_adam
def test_an_adamw_state_dict_makes_adam_adamw_as_in_torch():
    """torch.optim.Adam honours a loaded decoupled_weight_decay=True (it is AdamW then), and
    gradkit's AdamW writes the key, so its state dict does the same to torch's Adam."""
    source = torch.optim.AdamW(make_params(), lr=1e-2, weight_decay=0.5)
    step_with(source, [p for g in source.param_groups for p in g["params"]], gradients(1)[0])
    ours_adamw = gt.AdamW(make_params(), lr=1e-2, weight_decay=0.5)
    assert ours_adamw.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True
    for saved in (source.state_dict(), ours_adamw.state_dict()):
        ours, theirs = make_params(), make_params()
        a, b = gt.Adam(ours, lr=1e-2), torch.optim.Adam(theirs, lr=1e-2)
        a.load_state_dict(copy.deepcopy(saved))
        b.load_state_dict(copy.deepcopy(saved))
        assert a.param_groups[0]["decoupled_weight_decay"] and b.param_groups[0]["decoupled_weight_decay"]
        for step_grads in gradients(3, seed=2):
            step_with(a, ours, step_grads)
            step_with(b, theirs, step_grads)
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x, y, rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])
    # And AdamW stays AdamW whatever the loaded groups say, as torch.optim.AdamW.
    adam = torch.optim.Adam(make_params(), lr=1e-2, weight_decay=0.5)
    ours_adamw.load_state_dict(adam.state_dict())
    assert ours_adamw.param_groups[0]["decoupled_weight_decay"] is True


def test_state_dicts_move_between_lamb_and_adamw():
    """LAMB's state holds what AdamW's step needs (and the other way): each loads into the
    other, the groups' missing keys keeping the loading optimizer's values."""
    params = make_params()
    lamb = gt.Lamb(params, lr=1e-2)
    step_with(lamb, params, gradients(1)[0])
    adamw = gt.AdamW(make_params(), lr=1e-2)
    adamw.load_state_dict(lamb.state_dict())
    moved = [p for g in adamw.param_groups for p in g["params"]]
    assert torch.equal(adamw.state[moved[0]]["exp_avg"], lamb.state[params[0]]["exp_avg"])
    step_with(adamw, moved, gradients(1)[0])
    assert adamw.state_dict()["state"][0]["step"] == 2
    back = gt.Lamb(make_params(), lr=1e-2)
    back.load_state_dict(adamw.state_dict())
    step_with(back, [p for g in back.param_groups for p in g["params"]], gradients(1)[0])


def test_a_state_dict_this_optimizer_cannot_step_is_refused_before_loading():
    """Muon's momentum is no AdamW state: refused, naming the missing key, with the
    optimizer's groups and state as they were."""
    params = make_params()
    muon = gt.Muon(make_params(), lr=1e-2)
    step_with(muon, [p for g in muon.param_groups for p in g["params"]], gradients(1)[0])
    adamw = gt.AdamW(params, lr=3e-3)
    step_with(adamw, params, gradients(1)[0])
    before, groups = snapshot(adamw, params), copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                             for g in adamw.param_groups])
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[0\] has no 'exp_avg'"):
        adamw.load_state_dict(muon.state_dict())
    assert_unchanged(adamw, params, before)
    assert [{k: v for k, v in g.items() if k != "params"} for g in adamw.param_groups] == groups
    wrong_shape = copy.deepcopy(adamw.state_dict())
    wrong_shape["state"][2]["exp_avg"] = torch.zeros(8, 24)
    with pytest.raises(ValueError, match=r"state_dict\['state'\]\[2\]\['exp_avg'\] has shape \(8, 24\)"):
        adamw.load_state_dict(wrong_shape)
    assert_unchanged(adamw, params, before)


# -- hooks ----------------------------------------------------------------------------

@has_load_hooks
@every_config
def test_load_hooks_see_and_keep_the_state_as_the_steps_use_it(device, config):
    """A load post hook sees the state in this optimizer's form (8-bit codes stay uint8,
    masters float32), may put non-parameter keys in optimizer.state (torch's own tests do),
    and what it changes is what the next step uses."""
    dtype = CONFIGS[config][2]
    params, reference = make_params(dtype, device=device), make_params(dtype, device=device)
    opt, ref = build(config, params), build(config, reference)
    grads = gradients(3, dtype, device=device)
    step_with(opt, params, grads[0])
    step_with(ref, reference, grads[0])
    expected = {k: v.dtype for k, v in opt.state[params[0]].items() if torch.is_tensor(v)}
    seen = {}

    def pre_hook(optimizer, state_dict):
        state_dict["param_groups"][0]["lr"] = 5e-3
        return state_dict

    def post_hook(optimizer):
        seen.update({k: v.dtype for k, v in optimizer.state[params[0]].items() if torch.is_tensor(v)})
        optimizer.state["ran_load_state_dict_post_hook"] = True
        optimizer.param_groups[0]["weight_decay"] = 0.0

    opt.register_load_state_dict_pre_hook(pre_hook)
    opt.register_load_state_dict_post_hook(post_hook)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert seen == expected and opt.state["ran_load_state_dict_post_hook"] is True
    ref.param_groups[0]["lr"], ref.param_groups[0]["weight_decay"] = 5e-3, 0.0
    for step_grads in grads[1:]:
        step_with(opt, params, step_grads)
        step_with(ref, reference, step_grads)
    assert_equal_weights(params, reference)
    assert opt.state_bytes() == ref.state_bytes()
    opt.state_dict()  # the non-parameter key goes out as torch's does


@has_load_hooks
def test_state_dict_hooks_run_as_under_torch():
    params = make_params()
    opt = gt.AdamW(params, lr=1e-2, moments="int8", min_8bit_size=0)
    step_with(opt, params, gradients(1)[0])
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("pre", float(o.state[params[0]]["step"]))))

    def post(o, state_dict):
        calls.append(("post", state_dict["state"][0]["exp_avg"].dtype))
        state_dict["note"] = "kept"
        return state_dict

    opt.register_state_dict_post_hook(post)
    out = opt.state_dict()
    assert calls == [("pre", 1.0), ("post", torch.uint8)] and out["note"] == "kept"


@pytest.mark.skipif(not hasattr(torch.optim.Optimizer, "register_step_pre_hook"), reason="torch 2.0 or later")
@every_config
def test_step_hooks_run_once_a_step(config):
    dtype = CONFIGS[config][2]
    params = make_params(dtype)
    opt = build(config, params)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    for step_grads in gradients(2, dtype):
        step_with(opt, params, step_grads)
    assert calls == ["pre", "post", "pre", "post"]


# -- copies ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@every_config
def test_a_copy_goes_on_where_the_original_is(device, config, how):
    dtype = CONFIGS[config][2]
    params = make_params(dtype, device=device)
    opt = build(config, params)
    grads = gradients(6, dtype, device=device)
    for step_grads in grads[:3]:
        step_with(opt, params, step_grads)
    twin_params, twin = (copy.deepcopy((params, opt)) if how == "deepcopy"
                         else pickle.loads(pickle.dumps((params, opt))))
    for step_grads in grads[3:]:
        step_with(opt, params, step_grads)
        step_with(twin, twin_params, step_grads)
    assert_equal_weights(params, twin_params)
    assert twin.state_dict()["state"][0]["step"] == 6


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name", ["AdamW", "Lamb"])
def test_zero_grad_as_torch(name, set_to_none):
    params = make_params()
    opt = getattr(gt, name)(params)
    step_with(opt, params, gradients(1)[0])
    opt.zero_grad(set_to_none=set_to_none)
    assert all((p.grad is None) if set_to_none else torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    step_with(opt, params, gradients(1)[0])


# -- learning rates and arguments -------------------------------------------------------

@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_a_tensor_lr_steps_as_torch(name):
    ours, theirs = make_params(), make_params()
    a = getattr(gt, name)(ours, lr=torch.tensor(1e-2))
    b = getattr(torch.optim, name)(theirs, lr=torch.tensor(1e-2))
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (a, b)]
    for step_grads in gradients(6):
        step_with(a, ours, step_grads)
        step_with(b, theirs, step_grads)
        for s in schedules:
            s.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])


BAD_ARGUMENTS = [
    ({"betas": (1.0, 0.9)}, "betas"),
    ({"betas": (0.9, -0.1)}, "betas"),
    ({"lr": -1.0}, "lr"),
    ({"lr": torch.tensor([1e-3, 1e-3])}, "lr"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"),
]


@pytest.mark.parametrize("kwargs, argument", BAD_ARGUMENTS, ids=[a for _, a in BAD_ARGUMENTS])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_bad_arguments_raise_torchs_exception_naming_them(name, kwargs, argument):
    """torch 2's ValueError (torch 1.13 raises another type for a tensor lr of two values)."""
    with pytest.raises(Exception) as theirs:
        getattr(torch.optim, name)(make_params(), **kwargs)
    assert theirs.type is ValueError or not hasattr(torch.optim.Optimizer, "register_step_pre_hook")
    with pytest.raises(ValueError, match=argument):
        getattr(gt, name)(make_params(), **kwargs)
    with pytest.raises(ValueError, match=argument):
        gt.Lamb(make_params(), **kwargs)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "Lamb", "Muon"])
def test_params_that_are_no_parameters_raise_torchs_type_error(name):
    with pytest.raises(TypeError):
        torch.optim.AdamW(None)
    with pytest.raises(TypeError):
        getattr(gt, name)(None)
    with pytest.raises(TypeError, match="dtype"):
        getattr(gt, name)([torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4, 4).half())])


def test_a_group_hyperparameter_out_of_range_is_refused_naming_the_group():
    params = make_params()
    with pytest.raises(ValueError, match=r"param_groups\[1\]: betas\[1\] is 1.5"):
        gt.AdamW([{"params": params[:1]}, {"params": params[1:], "betas": (0.9, 1.5)}])


def test_an_adamw_pickled_without_the_weight_decay_key_stays_adamw():
    """A pickle whose groups lack "decoupled_weight_decay" (an older gradkit's) unpickles
    into AdamW's decay for AdamW and Adam's L2 decay for Adam, as torch's classes do."""
    for cls, decoupled in ((gt.AdamW, True), (gt.Adam, False)):
        params = make_params()
        opt = cls(params, lr=1e-2, weight_decay=0.5)
        step_with(opt, params, gradients(1)[0])
        state = opt.__getstate__()
        for group in state["param_groups"]:
            del group["decoupled_weight_decay"]
        older = pickle.loads(pickle.dumps(state))
        twin = cls.__new__(cls)
        twin.__setstate__(older)
        assert all(g["decoupled_weight_decay"] is decoupled for g in twin.param_groups)


def _takes_named_parameters():
    try:
        torch.optim.SGD([("w", torch.nn.Parameter(torch.ones(1)))], lr=0.1)
        return True
    except TypeError:
        return False


@pytest.mark.parametrize("named", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _takes_named_parameters(), reason="named parameters need torch 2.6 or later"))])
def test_one_cycle_schedule_and_named_parameters_as_torch(named):
    """OneCycleLR cycles betas[0] every step by default (cycle_momentum=True), and torch 2.6
    takes model.named_parameters(): the run equals torch.optim.AdamW's."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    theirs = copy.deepcopy(ours)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    for model, cls in ((ours, gt.AdamW), (theirs, torch.optim.AdamW)):
        opt = cls(model.named_parameters() if named else model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=30)
        for _ in range(30):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            schedule.step()
        if named:
            assert opt.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=TORCH_100_STEPS[0], atol=TORCH_100_STEPS[1])
