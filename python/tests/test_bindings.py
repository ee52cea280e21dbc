"""The nanobind module over the C++ API, with numpy (CPU) and torch (CUDA)
arrays through DLPack, against float64 references written here."""
import numpy as np
import pytest

import gradkit
from arrays import normal, read, to_device
from tolerances import NORM, REFERENCE_STEP

SIZES = [5000, 17, 70001]


def adam_reference(w, g, m, v, t, h):
    """torch.optim's Adam/AdamW update in float64 (docs/ops.md, adam_step)."""
    w, g, m, v = (x.astype(np.float64) for x in (w, g, m, v))
    if h.decay == gradkit.WeightDecay.l2:
        g = g + h.weight_decay * w
    else:
        w = w * (1 - h.lr * h.weight_decay)
    m = m + (1 - h.beta1) * (g - m)
    v = v * h.beta2 + (1 - h.beta2) * g * g
    bias1, bias2 = 1 - h.beta1 ** t, 1 - h.beta2 ** t
    w = w - (h.lr / bias1) * (m / (np.sqrt(v) / np.sqrt(bias2) + h.eps))
    return w, m, v


def make_lists(rng, device, sizes=SIZES):
    w = [normal(rng, n) for n in sizes]
    g = [normal(rng, n) for n in sizes]
    m = [normal(rng, n, scale=0.1) for n in sizes]
    v = [np.abs(normal(rng, n, scale=0.1)) for n in sizes]
    return (w, g, m, v), [[to_device(x, device) for x in lst] for lst in (w, g, m, v)]


@pytest.mark.torch_free
def test_adam_plan_matches_the_float64_reference_per_group(rng, device):
    (w, g, m, v), (dw, dg, dm, dv) = make_lists(rng, device)
    hypers = [gradkit.AdamHyperparameters(lr=1e-2, weight_decay=0.05),
              gradkit.AdamHyperparameters(lr=3e-3, beta1=0.8, weight_decay=0.1, decay=gradkit.WeightDecay.l2)]
    groups = [0, 1, 0]
    plan = gradkit.AdamPlan(dw, dg, dm, dv, hypers, groups)
    plan.step(step=3)
    gradkit.synchronize(device)
    rtol, atol = REFERENCE_STEP[np.float32]
    for i in range(len(SIZES)):
        rw, rm, rv = adam_reference(w[i], g[i], m[i], v[i], 3, hypers[groups[i]])
        np.testing.assert_allclose(read(dw[i]), rw, rtol=rtol, atol=atol)
        np.testing.assert_allclose(read(dm[i]), rm, rtol=rtol, atol=atol)
        np.testing.assert_allclose(read(dv[i]), rv, rtol=rtol, atol=atol)


@pytest.mark.torch_free
def test_float64_lists_match_closely(rng):
    w, g, m, v = ([x.astype(np.float64) for x in lst] for lst in make_lists(rng, "cpu")[0])
    h = gradkit.AdamHyperparameters(lr=1e-2, weight_decay=0.01)
    expected = [adam_reference(*args, 1, h)[0] for args in zip(w, g, m, v)]
    gradkit.AdamPlan(w, g, m, v, [h]).step(step=1)
    rtol, atol = REFERENCE_STEP[np.float64]
    for got, want in zip(w, expected):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.torch_free
def test_device_step_and_lr_give_the_host_values_result(rng, device):
    _, a = make_lists(rng, device)
    rng2 = np.random.default_rng(20261122)
    _, b = make_lists(rng2, device)
    h = gradkit.AdamHyperparameters(lr=1.0)  # replaced by lr_device below
    gradkit.AdamPlan(*a, [h]).step(step=4, lr_device=to_device(np.array([2e-3], np.float32), device))
    counter = to_device(np.array([3], np.int64), device)
    gradkit.advance_step(counter)
    h.lr = 2e-3
    gradkit.AdamPlan(*b, [h]).step(step_device=counter, lr_device=to_device(np.array([2e-3], np.float32), device))
    gradkit.synchronize(device)
    assert read(counter)[0] == 4
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(read(x), read(y))


@pytest.mark.torch_free
def test_found_inf_skips_the_step_and_the_counter(rng, device):
    _, (dw, dg, dm, dv) = make_lists(rng, device)
    before = [read(x) for x in dw + dm + dv]
    flag = to_device(np.array([True]), device)
    counter = to_device(np.array([7], np.int64), device)
    gradkit.advance_step(counter, skip=flag)
    gradkit.AdamPlan(dw, dg, dm, dv, [gradkit.AdamHyperparameters()]).step(step_device=counter, found_inf=flag)
    gradkit.synchronize(device)
    assert read(counter)[0] == 7
    for x, y in zip(before, dw + dm + dv):
        np.testing.assert_array_equal(x, read(y))


@pytest.mark.torch_free
def test_set_grads_gives_the_result_of_a_new_plan(rng, device):
    _, (dw, dg, dm, dv) = make_lists(rng, device)
    rng2 = np.random.default_rng(20261122)
    _, (ew, eg, em, ev) = make_lists(rng2, device)
    other = [to_device(normal(rng, n), device) for n in SIZES]
    h = [gradkit.AdamHyperparameters()]
    plan = gradkit.AdamPlan(dw, dg, dm, dv, h)
    plan.set_grads(other)
    plan.step(step=1)
    gradkit.AdamPlan(ew, other, em, ev, h).step(step=1)
    gradkit.synchronize(device)
    for x, y in zip(dw, ew):
        np.testing.assert_array_equal(read(x), read(y))


@pytest.mark.torch_free
def test_bad_inputs_raise_naming_the_argument_and_write_nothing(rng):
    (w, g, m, v), _ = make_lists(rng, "cpu")
    before = [x.copy() for x in w + m + v]
    h = [gradkit.AdamHyperparameters()]
    with pytest.raises(ValueError, match=r"grads\[1\]' has 16 elements, expected 17"):
        gradkit.AdamPlan(w, [g[0], g[1][:16], g[2]], m, v, h)
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        gradkit.AdamPlan(w, [g[0].astype(np.int32), g[1], g[2]], m, v, h)
    with pytest.raises(ValueError, match=r"not contiguous"):
        gradkit.AdamPlan(w, [g[0][::2].repeat(2)[::2], g[1], g[2]], m, v, h)
    with pytest.raises(ValueError, match=r"beta1' is 1, expected a value in \[0, 1\)"):
        gradkit.AdamPlan(w, g, m, v, [gradkit.AdamHyperparameters(beta1=1.0)])
    with pytest.raises(ValueError, match=r"overlaps"):
        gradkit.AdamPlan(w, g, [w[0], m[1], m[2]], v, h)
    plan = gradkit.AdamPlan(w, g, m, v, h)
    with pytest.raises(ValueError, match=r"step' is 0, expected >= 1"):
        plan.step(step=0)
    with pytest.raises(ValueError, match=r"grad_scale' is inf"):
        plan.step(grad_scale=float("inf"))
    with pytest.raises(ValueError, match=r"lr_device' has 2 elements"):
        plan.step(lr_device=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"size_mismatch|grads' has 2 tensors, expected 3"):
        plan.set_grads(g[:2])
    for x, y in zip(before, w + m + v):
        np.testing.assert_array_equal(x, y)


@pytest.mark.torch_free
def test_nan_gradients_propagate_without_found_inf(rng):
    (w, g, m, v), _ = make_lists(rng, "cpu", [8])
    g[0][3] = np.nan
    gradkit.AdamPlan(w, g, m, v, [gradkit.AdamHyperparameters()]).step()
    assert np.isnan(w[0][3]) and np.isnan(m[0][3]) and np.isfinite(np.delete(w[0], 3)).all()


@pytest.mark.torch_free
def test_gradient_check_finds_inf_and_folds_scale_and_clip(rng, device):
    grads = [normal(rng, n) * 1024 for n in SIZES]
    dg = [to_device(x, device) for x in grads]
    out = {k: to_device(np.zeros(1, np.float32), device) for k in ("grad_divisor", "global_norm")}
    found = to_device(np.zeros(1, bool), device)
    norms = to_device(np.zeros(len(SIZES), np.float32), device)
    plan = gradkit.GradientCheckPlan(dg, max_norm=1.0)
    plan.check(found_inf=found, tensor_norms=norms, loss_scale=1024.0, **out)
    gradkit.synchronize(device)
    norm = np.sqrt(sum(((x.astype(np.float64) / 1024) ** 2).sum() for x in grads))
    assert not read(found)[0]
    np.testing.assert_allclose(read(out["global_norm"])[0], norm, rtol=NORM[0])
    np.testing.assert_allclose(read(out["grad_divisor"])[0], 1024.0 / (1.0 / (norm + 1e-6)), rtol=NORM[0])
    np.testing.assert_allclose(read(norms), [np.linalg.norm(x.astype(np.float64) / 1024) for x in grads], rtol=NORM[0])
    grads[2][123] = np.inf
    plan2 = gradkit.GradientCheckPlan([to_device(x, device) for x in grads])
    plan2.check(found_inf=found, loss_scale=1024.0, **out)
    gradkit.synchronize(device)
    assert read(found)[0] and not np.isfinite(read(out["global_norm"])[0])


@pytest.mark.torch_free
def test_loss_scaler_makes_grad_scalers_decisions(device):
    s = gradkit.LossScaler(device, gradkit.LossScalerOptions(initial_scale=8.0, growth_interval=2))
    inf = to_device(np.array([True]), device)
    clean = to_device(np.array([False]), device)
    seen = []
    for flag in (clean, clean, clean, inf, clean):
        s.update(flag)
        seen.append(s.state()[0])
    assert seen == [8.0, 16.0, 16.0, 8.0, 8.0]
    assert read(s.scale_device)[0] == 8.0
    with pytest.raises(ValueError, match="growth_factor"):
        gradkit.LossScaler(device, gradkit.LossScalerOptions(growth_factor=0.5))


@pytest.mark.torch_free
def test_gradient_arena_views_share_one_allocation(device):
    arena = gradkit.GradientArena(device, gradkit.DType.f32, [3, 100, 1])
    assert len(arena) == 3
    views = arena.gradients()
    info = [gradkit.view_info(v) for v in views]
    assert [i[1] for i in info] == [3, 100, 1]
    assert all(i[0] % 256 == 0 for i in info)
    flat = gradkit.view_info(arena.flat())
    assert flat[0] == info[0][0] and flat[0] + 4 * flat[1] == info[2][0] + 4


@pytest.mark.torch_free
def test_errors_map_to_python_exception_types(tmp_path):
    with pytest.raises(ValueError, match="device"):
        gradkit.LossScaler("gpu")
    adam = gradkit.Adam([{"params": [np.ones(4, np.float32)], "grads": [np.ones(4, np.float32)]}])
    with pytest.raises(OSError):
        adam.load("/nonexistent/state")
    # Files that are no state file: named, as OSError, and never read whole
    # (/dev/zero has no end).
    with pytest.raises(OSError, match="is a directory"):
        adam.load(str(tmp_path))
    with pytest.raises(OSError, match="is not a regular file"):
        adam.load("/dev/zero")


@pytest.mark.torch_free
def test_gradient_check_partials_of_shards_combine_to_the_whole_lists_check(rng, device):
    """Two shards of the same gradients (the ranks' local tensors under FSDP2):
    each checked with `partial`, the partials combined, give the whole list's
    flag, norm and divisor."""
    grads = [normal(rng, n) * 64 for n in SIZES]
    halves = [[x[: len(x) // 2] for x in grads], [x[len(x) // 2:] for x in grads]]
    out = {k: to_device(np.zeros(1, np.float32), device) for k in ("grad_divisor", "global_norm")}
    found = to_device(np.zeros(1, bool), device)
    partials = [to_device(np.zeros(2, np.float64), device) for _ in halves]
    plans = [gradkit.GradientCheckPlan([to_device(x, device) for x in h], max_norm=1.0) for h in halves]
    for plan, partial in zip(plans, partials):
        plan.check(partial=partial, loss_scale=64.0)
    both = to_device(np.concatenate([read(p) for p in partials]), device)
    plans[0].combine(both, 2, found_inf=found, loss_scale=64.0, **out)
    gradkit.synchronize(device)
    norm = np.sqrt(sum(((x.astype(np.float64) / 64) ** 2).sum() for x in grads))
    assert not read(found)[0]
    np.testing.assert_allclose(read(out["global_norm"])[0], norm, rtol=NORM[0])
    np.testing.assert_allclose(read(out["grad_divisor"])[0], 64.0 * (norm + 1e-6), rtol=NORM[0])
    with pytest.raises(ValueError, match="count"):
        plans[0].combine(both, 0, found_inf=found)
    with pytest.raises(ValueError, match="partials"):
        plans[0].combine(both, 3, found_inf=found)
    halves[1][2][7] = np.inf  # one shard's Inf: the combined check finds it
    plan = gradkit.GradientCheckPlan([to_device(x, device) for x in halves[1]])
    plan.check(partial=partials[1])
    both = to_device(np.concatenate([read(p) for p in partials]), device)
    plans[0].combine(both, 2, found_inf=found, **out)
    gradkit.synchronize(device)
    assert read(found)[0] and not np.isfinite(read(out["global_norm"])[0])


@pytest.mark.torch_free
def test_lamb_in_two_passes_over_shards_is_the_whole_step(rng, device):
    """LAMB's trust ratios need each whole tensor's norms: two shards' plans,
    pass 1 each, their rows of sums side by side, pass 2 each, give the
    unsharded step."""
    (w, g, m, v), whole = make_lists(rng, device)
    hypers = [gradkit.LambHyperparameters(lambda_=0.01)]
    gradkit.LambPlan(*whole, hypers).step(eta=1e-2)
    cut = [len(x) // 3 for x in w]
    shards = [[[to_device(x[:c], device) for x, c in zip(lst, cut)] for lst in (w, g, m, v)],
              [[to_device(x[c:], device) for x, c in zip(lst, cut)] for lst in (w, g, m, v)]]
    plans = [gradkit.LambPlan(*s, hypers) for s in shards]
    n = len(SIZES)
    rows = [to_device(np.zeros(2 * n, np.float64), device) for _ in plans]
    for plan, row in zip(plans, rows):
        plan.step(eta=1e-2, split="first", sums=row)
    both = to_device(np.concatenate([read(r) for r in rows]), device)
    for plan in plans:
        plan.step(eta=1e-2, split="second", sums=both, rows=2)
    gradkit.synchronize(device)
    rtol, atol = REFERENCE_STEP[np.float32]
    for i in range(n):
        got = np.concatenate([read(shards[0][0][i]), read(shards[1][0][i])])
        np.testing.assert_allclose(got, read(whole[0][i]), rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="split"):
        plans[0].step(split="third", sums=rows[0])
    with pytest.raises(ValueError, match="rows"):
        plans[0].step(split="second", sums=both, rows=0)
    with pytest.raises(ValueError, match="sums"):
        plans[0].step(split="second", sums=rows[0], rows=2)
    with pytest.raises(ValueError, match="sums"):
        plans[0].step(sums=rows[0])


def test_mixed_precision_keeps_its_masters_either_way(rng):
    """MixedPrecisionAdam over bfloat16 weights with float32 masters and with
    remainder masters, fed the same gradients: the remainders joined to their
    weights are the float32 masters bit for bit; float16 weights with
    remainders are refused naming the tensor."""
    torch = pytest.importorskip("torch")
    sizes = (300, 7)
    start = [torch.from_numpy(normal(rng, n)).to(torch.bfloat16) for n in sizes]
    grads = [torch.from_numpy(normal(rng, n)).to(torch.bfloat16) for n in sizes]
    hyper = gradkit.AdamHyperparameters(lr=1e-2, weight_decay=0.01)
    scaler = gradkit.LossScalerOptions(mode=gradkit.LossScaling.none)
    runs = {}
    for master in (gradkit.MasterStorage.f32, gradkit.MasterStorage.remainder):
        weights = [w.clone() for w in start]
        opt = gradkit.MixedPrecisionAdam([{"params": weights, "grads": grads, "hyperparameters": hyper}],
                                         scaler=scaler, master=master)
        for _ in range(5):
            opt.step()
        runs[master] = (opt, weights)
    f32, _ = runs[gradkit.MasterStorage.f32]
    rem, rem_weights = runs[gradkit.MasterStorage.remainder]
    assert len(f32.masters) == 2 and len(f32.weight_remainders) == 0
    assert len(rem.masters) == 0 and len(rem.weight_remainders) == 2
    for w, r, m in zip(rem_weights, rem.weight_remainders, f32.masters):
        joined = torch.empty(w.shape, dtype=torch.float32)
        gradkit.join_masters(w, torch.from_dlpack(r), joined)
        assert torch.equal(joined.view(torch.int32), torch.from_dlpack(m).view(torch.int32))
    half = [torch.zeros(4, dtype=torch.float16)]
    with pytest.raises(TypeError, match=r"groups\[0\]\.params\[0\].*expected bf16"):
        gradkit.MixedPrecisionAdam([{"params": half, "grads": half, "hyperparameters": hyper}],
                                   master=gradkit.MasterStorage.remainder)
