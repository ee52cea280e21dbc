"""gradkit.torch.Adam/AdamW with 8-bit moments (moments="int8"), 4-bit moments
(moments="int4") and remainder
masters (master="remainder"), and Lamb with both (apart): one step against a float64 reference written
here from docs/ops.md (decode, update, encode with the nearest code), the
remainder master against the float32-master path bit for bit, state_dict
round trips and conversions, skipped steps, flat gradients, bad arguments,
and training curves against float32 AdamW."""
import copy
import io
import os
import typing

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
import models  # noqa: E402
from tolerances import (INT4_EARLY_FINAL_LOSS, INT4_FINAL_LOSS, INT8_CODE_DISTANCE, INT8_STEP_WEIGHTS,  # noqa: E402
                        LAMB_INT4_MOVEMENT, LOW_BIT_ACCURACY, LOW_BIT_FINAL_LOSS, TRAINING_WINDOW)

SHAPES = [(300,), (17, 5), (1000,), (1,), (256,)]
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.05
CODES = {"exp_avg": gradkit.QuantCode.signed_dynamic, "exp_avg_sq": gradkit.QuantCode.unsigned_dynamic}


def make_params(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in SHAPES]


def grads_for(step, device, dtype=torch.float32, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return [(torch.randn(s, generator=g) * 0.1).to(device=device, dtype=dtype) for s in SHAPES]


def run(params, opt, steps, device, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, grads_for(s, device, params[0].dtype)):
            p.grad = g
        opt.step()


def table(name):
    return np.array(gradkit.quant_code(CODES[name]), dtype=np.float64)


def nearest_codes(values, name):
    """The float64 reference's encoding: per 256-element block, the nearest code to value / absmax."""
    codes, out = table(name), np.empty(values.size, dtype=np.int64)
    for b in range(0, values.size, gradkit.QUANT_BLOCK):
        x = values[b:b + gradkit.QUANT_BLOCK]
        absmax = np.abs(x).max()
        scaled = x / absmax if absmax > 0 else x
        out[b:b + gradkit.QUANT_BLOCK] = np.abs(scaled[:, None] - codes[None, :]).argmin(axis=1)
    return out


def decoded(state, name):
    """The moments the kernel reads: code * absmax, a float32 product (docs/ops.md)."""
    codes = state[name].cpu().numpy().astype(np.int64).ravel()
    absmax = np.repeat(state[name + "_absmax"].cpu().numpy(), gradkit.QUANT_BLOCK)[:codes.size]
    return (table(name).astype(np.float32)[codes] * absmax).astype(np.float64)


def test_one_int8_step_matches_the_float64_reference(device):
    params = make_params(device)
    opt = gt.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, moments="int8", min_8bit_size=0)
    run(params, opt, 5, device)  # moments that are not zero
    t = 6
    before = [(p.detach().cpu().double().numpy().ravel(), decoded(opt.state[p], "exp_avg"),
               decoded(opt.state[p], "exp_avg_sq")) for p in params]
    run(params, opt, 1, device, start=5)
    b1, b2 = BETAS
    bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t
    for p, g, (w, m, v) in zip(params, grads_for(5, device), before):
        g = g.cpu().double().numpy().ravel()
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        w = w * (1 - LR * WD) - (LR / bias1) * m / (np.sqrt(v) / np.sqrt(bias2) + EPS)
        np.testing.assert_allclose(p.detach().cpu().numpy().ravel(), w, rtol=INT8_STEP_WEIGHTS[0],
                                   atol=INT8_STEP_WEIGHTS[1])
        for name, ref in (("exp_avg", m), ("exp_avg_sq", v)):
            ours = opt.state[p][name].cpu().numpy().astype(np.int64).ravel()
            assert np.abs(ours - nearest_codes(ref, name)).max() <= INT8_CODE_DISTANCE, name


def assert_remainder_keeps_the_float32_masters(make_optimizer, device, steps=100):
    """Two bfloat16 models, one with float32 masters and one with remainder masters
    (make_optimizer(params, master)), fed the same gradients: after `steps` steps the
    masters are the same bits, and the weights differ only by the rounding rule."""
    a, b = make_params(device, torch.bfloat16), make_params(device, torch.bfloat16)
    opt_a, opt_b = make_optimizer(a, "float32"), make_optimizer(b, "remainder")
    for s in range(steps):
        for pa, pb, g in zip(a, b, grads_for(s, device, torch.bfloat16)):
            pa.grad, pb.grad = g, g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb, ma, mb in zip(a, b, opt_a.master_params(), opt_b.master_params()):
        assert torch.equal(ma.view(torch.int32), mb.view(torch.int32)), "the masters differ"
        # The float32-master path's weights are the masters rounded to nearest even; the
        # remainder path's round ties away from zero: they differ exactly at ties.
        assert torch.equal(pa.detach(), ma.to(torch.bfloat16))
        tie = (mb.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(pa.detach()[~tie], pb.detach()[~tie])
        away = pb.detach()[tie].float().abs() >= ma[tie].abs()
        assert bool(away.all())
    state_b = opt_b.state[b[0]]
    assert "master_param" not in state_b and state_b["weight_remainder"].dtype == torch.int16


@pytest.mark.parametrize("moments", ["float32", "int8"])
def test_remainder_master_equals_the_float32_master_bit_for_bit(device, moments):
    assert_remainder_keeps_the_float32_masters(
        lambda params, master: gt.AdamW(params, lr=LR, weight_decay=WD, moments=moments, master=master), device)


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_lamb_remainder_master_equals_the_float32_master_bit_for_bit(device, moments):
    assert_remainder_keeps_the_float32_masters(
        lambda params, master: gt.Lamb(params, lr=LR, weight_decay=WD, moments=moments, master=master), device)


@pytest.mark.parametrize("optimizer,form", [(gt.AdamW, {"moments": "int8", "min_8bit_size": 0}),
                                            (gt.AdamW, {"moments": "int4", "min_4bit_size": 0}),
                                            (gt.AdamW, {"moments": "int4", "master": "remainder", "min_4bit_size": 0}),
                                            (gt.AdamW, {"moments": "bfloat16"}),
                                            (gt.AdamW, {"moments": "int8", "master": "remainder", "min_8bit_size": 0}),
                                            (gt.Lamb, {"master": "remainder"}),
                                            (gt.Lamb, {"moments": "bfloat16", "master": "remainder"})],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_resume_from_state_dict_equals_the_straight_run(device, optimizer, form):
    dtype = torch.bfloat16 if form.get("master") == "remainder" else torch.float32
    straight = make_params(device, dtype)
    opt = optimizer(straight, lr=LR, weight_decay=WD, **form)
    run(straight, opt, 20, device)

    resumed = make_params(device, dtype)
    first = optimizer(resumed, lr=LR, weight_decay=WD, **form)
    run(resumed, first, 10, device)
    saved = copy.deepcopy(first.state_dict())
    second = optimizer(resumed, lr=1.0, **form)
    second.load_state_dict(saved)
    for name, t in second.state[resumed[0]].items():  # the compact state comes back bit for bit
        if not torch.is_tensor(t):  # 4-bit moments' map
            assert t == saved["state"][0][name], name
            continue
        assert t.dtype == saved["state"][0][name].dtype and torch.equal(t.cpu(), saved["state"][0][name].cpu()), name
    run(resumed, second, 10, device, start=10)
    for p, q in zip(straight, resumed):
        assert torch.equal(p.detach(), q.detach())
    assert second.state_dict()["state"][0]["step"] == 20


def test_a_4bit_state_dict_of_the_linear_map_is_refused(device):
    """Before state format 4 the 4-bit second moment was on the linear map, whose codes mean
    other values: a parameter's state holding 4-bit codes without the DE-0 mark is refused,
    naming it and the key, before anything is loaded. The optimizer's state keeps the mark
    beside the codes, and only there."""
    params = make_params(device)
    opt = gt.AdamW(params, lr=LR, weight_decay=WD, moments="int4", min_4bit_size=0)
    run(params, opt, 3, device)
    saved = copy.deepcopy(opt.state_dict())
    assert [s["int4_second_moment_map"] for s in saved["state"].values()] == [1] * len(params)
    old = copy.deepcopy(saved)
    del old["state"][2]["int4_second_moment_map"]
    with pytest.raises(ValueError, match="state_dict's state 2 holds 4-bit moments with 'int4_second_moment_map' "
                                         "None, expected 1 \\(DE-0\\).*linear map"):
        opt.load_state_dict(old)
    for i, p in enumerate(params):
        for name, t in opt.state[p].items():
            assert t == 1 if name == "int4_second_moment_map" else torch.equal(t.cpu(), saved["state"][i][name].cpu())
    opt.load_state_dict(saved)
    assert all(opt.state[p]["int4_second_moment_map"] == 1 for p in params)
    # Without 4-bit codes there is no mark: torch.optim's state, or a float32 export.
    exported = opt.float32_state_dict()
    assert all("int4_second_moment_map" not in s for s in exported["state"].values())
    torch_opt = torch.optim.AdamW(params, lr=LR)
    torch_opt.load_state_dict(exported)
    opt.load_state_dict(torch_opt.state_dict())
    assert all(opt.state[p]["int4_second_moment_map"] == 1 for p in params)  # encoded again: marked again
    int8 = gt.AdamW(params, lr=LR, moments="int8", min_8bit_size=0)
    int8.load_state_dict(saved)
    assert all("int4_second_moment_map" not in int8.state[p] for p in params)


def test_a_flattened_checkpoint_state_dict_keeps_4bit_codes_loadable(device):
    """torch.distributed.checkpoint's flattened optimizer state dict rebuilds each state from the
    loading optimizer's own keys: the DE-0 mark travels because the optimizer keeps it, and the
    codes come back bit for bit."""
    checkpoint = pytest.importorskip("torch.distributed.checkpoint.state_dict",
                                     reason="torch.distributed.checkpoint.state_dict came in torch 2.2")
    if "flatten_optimizer_state_dict" not in checkpoint.StateDictOptions.__dataclass_fields__:
        pytest.skip(f"torch {torch.__version__}'s StateDictOptions has no flatten_optimizer_state_dict")
    StateDictOptions = checkpoint.StateDictOptions
    get_optimizer_state_dict, set_optimizer_state_dict = (checkpoint.get_optimizer_state_dict,
                                                          checkpoint.set_optimizer_state_dict)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8)).to(device)
    opt = gt.AdamW(model.parameters(), lr=LR, moments="int4", min_4bit_size=0)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(device)).sum().backward()
        opt.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    saved = get_optimizer_state_dict(model, opt, options=flat)
    assert saved["state.0.weight.int4_second_moment_map"] == 1
    before = {k: v.clone() for k, v in opt.state[model[0].weight].items() if torch.is_tensor(v)}
    set_optimizer_state_dict(model, opt, saved, options=flat)
    after = opt.state[model[0].weight]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_torch_optim_state_loads_quantized_and_exports_back(device):
    ref = make_params(device)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=WD)
    run(ref, ref_opt, 10, device)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = gt.AdamW(ours, lr=LR, weight_decay=WD, moments="int8", min_8bit_size=0)
    opt.load_state_dict(ref_opt.state_dict())
    for p, r in zip(ours, ref):
        for name in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p]
            assert s[name].dtype == torch.uint8 and s[name + "_absmax"].numel() == gradkit.quant_blocks(p.numel())
            want = ref_opt.state[r][name].cpu().double().numpy().ravel()
            assert np.abs(s[name].cpu().numpy().astype(np.int64).ravel() - nearest_codes(want, name)).max() \
                <= INT8_CODE_DISTANCE
    exported = opt.float32_state_dict()
    back = torch.optim.AdamW(ours, lr=LR)
    back.load_state_dict(exported)
    for p in ours:
        for name in ("exp_avg", "exp_avg_sq"):
            assert back.state[p][name].dtype == torch.float32
            np.testing.assert_allclose(back.state[p][name].cpu().double().numpy().ravel(),
                                       decoded(opt.state[p], name), rtol=0, atol=0)
    run(ours, back, 2, device, start=10)  # torch.optim goes on from it


def test_torch_optim_state_loads_as_4bit_and_exports_back(device):
    """torch.optim.AdamW's float32 state loads into the 4-bit form (flat codes, two a byte,
    and an absmax per 128 elements, as gradkit.quantize_blockwise4 encodes it), and
    float32_state_dict() gives back what the codes decode to, which torch.optim goes on from."""
    ref = make_params(device)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=WD)
    run(ref, ref_opt, 10, device)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = gt.AdamW(ours, lr=LR, weight_decay=WD, moments="int4", min_4bit_size=0)
    opt.load_state_dict(ref_opt.state_dict())
    for p, r in zip(ours, ref):
        for name in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p]
            assert s[name].dtype == torch.uint8 and s[name].numel() == gradkit.quant4_bytes(p.numel())
            assert s[name + "_absmax4"].numel() == gradkit.quant4_blocks(p.numel())
            codes = torch.empty_like(s[name])
            absmax = torch.empty_like(s[name + "_absmax4"])
            gradkit.quantize_blockwise4(CODES[name], ref_opt.state[r][name].reshape(-1).contiguous(), codes, absmax)
            assert torch.equal(codes, s[name]) and torch.equal(absmax, s[name + "_absmax4"])
    exported = opt.float32_state_dict()
    back = torch.optim.AdamW(ours, lr=LR)
    back.load_state_dict(exported)
    for p in ours:
        for name in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p]
            want = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
            gradkit.dequantize_blockwise4(CODES[name], s[name], s[name + "_absmax4"], want)
            assert back.state[p][name].dtype == torch.float32
            assert torch.equal(back.state[p][name].reshape(-1), want)
    # the second moment's map has no zero: every decoded v is positive where its block is not all zero
    assert all((back.state[p]["exp_avg_sq"] > 0).all() for p in ours)
    run(ours, back, 2, device, start=10)  # torch.optim goes on from it


@pytest.mark.parametrize("optimizer", [gt.AdamW, gt.Lamb], ids=lambda x: x.__name__)
def test_float32_master_state_loads_into_the_remainder_form(device, optimizer):
    a = make_params(device, torch.bfloat16)
    opt_a = optimizer(a, lr=LR)
    run(a, opt_a, 10, device)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = optimizer(b, lr=LR, master="remainder")
    opt_b.load_state_dict(opt_a.state_dict())
    for ma, mb in zip(opt_a.master_params(), opt_b.master_params()):
        assert torch.equal(ma, mb)
    exported = opt_b.float32_state_dict()["state"][0]
    assert exported["master_param"].dtype == torch.float32 and "weight_remainder" not in exported
    # Both go on alike: the remainder form's steps keep the float32 form's masters.
    run(a, opt_a, 5, device, start=10)
    run(b, opt_b, 5, device, start=10)
    for ma, mb in zip(opt_a.master_params(), opt_b.master_params()):
        assert torch.equal(ma.view(torch.int32), mb.view(torch.int32))


def test_an_inf_gradient_skips_the_amp_step_and_writes_nothing(device):
    params = make_params(device, torch.bfloat16)
    opt = gt.AdamW(params, lr=LR, moments="int8", min_8bit_size=0, master="remainder")
    amp = gt.AmpStep(opt, max_norm=1.0, init_scale=1.0)
    run(params, opt, 3, device)
    before = [p.detach().clone() for p in params] + [t.clone() for s in opt.state.values()
                                                     for k, t in s.items() if k != "step"]
    for p, g in zip(params, grads_for(3, device, torch.bfloat16)):
        p.grad = g
    params[2].grad[7] = float("inf")
    amp.step()
    after = [p.detach() for p in params] + [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert opt.state_dict()["state"][0]["step"] == 3
    for p, g in zip(params, grads_for(4, device, torch.bfloat16)):
        p.grad = g
    amp.step()
    assert opt.state_dict()["state"][0]["step"] == 4


def test_flat_gradients_step_the_int8_state_as_each_grad_does(device):
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5)).to(device)
    b = copy.deepcopy(a)
    opt_a, opt_b = (gt.AdamW(m.parameters(), moments="int8", min_8bit_size=0) for m in (a, b))
    gt.flat_gradients(a, opt_a)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        x, y = torch.randn(16, 20, generator=g).to(device), torch.randn(16, 5, generator=g).to(device)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_state_bytes_per_parameter(device):
    counts = {}
    int8 = {"moments": "int8", "min_8bit_size": 0}
    int4 = {"moments": "int4", "min_4bit_size": 0}
    for name, dtype, form in (("f32", torch.float32, {}), ("int8", torch.float32, int8), ("bf16", torch.bfloat16, {}),
                              ("bf16 int8 remainder", torch.bfloat16, {**int8, "master": "remainder"}),
                              ("int4", torch.float32, int4),
                              ("bf16 int4 remainder", torch.bfloat16, {**int4, "master": "remainder"})):
        params = make_params(device, dtype)
        opt = gt.AdamW(params, **form)
        run(params, opt, 1, device)
        counts[name] = opt.state_bytes() / sum(p.numel() for p in params)
    assert counts["f32"] == 8 and counts["bf16"] == 12
    assert 2 < counts["int8"] <= 2.1 and 4 < counts["bf16 int8 remainder"] <= 4.1
    # the 4-bit forms' bounds: 1.1 and 3.1 (these small tensors' last blocks are short: 1.07 and 3.07)
    assert 1 < counts["int4"] <= 1.1 and 3 < counts["bf16 int4 remainder"] <= 3.1


LOW_BIT_FORMS = [{"moments": "int8", "min_8bit_size": 0}, {"moments": "int8", "master": "remainder", "min_8bit_size": 0},
                 {"moments": "int4", "min_4bit_size": 0}, {"moments": "int4", "master": "remainder", "min_4bit_size": 0}]


def storage_start(t):
    """The address of the storage t views (torch 1.13 has no untyped_storage)."""
    return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).data_ptr()


def low_bit_tensors(opt, params):
    """Each parameter's 8- and 4-bit codes, absmax and remainder."""
    return [t for p in params for k, t in opt.state[p].items()
            if torch.is_tensor(t) and (t.dtype in (torch.uint8, torch.int16) or k.endswith(("_absmax", "_absmax4")))]


@pytest.mark.parametrize("form", LOW_BIT_FORMS, ids=lambda f: f["moments"] + " " + f.get("master", "float32"))
def test_low_bit_state_is_cut_from_one_buffer_per_dtype(device, form):
    """A first step's low-bit state is views of one buffer per dtype (the caching
    allocator rounds no tensor of it on its own): disjoint, each 256 bytes past another;
    through torch.save and torch.load it resumes bit for bit."""
    dtype = torch.bfloat16 if form.get("master") == "remainder" else torch.float32
    params = make_params(device, dtype)
    opt = gt.AdamW(params, lr=LR, weight_decay=WD, **form)
    run(params, opt, 1, device)
    low = low_bit_tensors(opt, params)
    assert low and any(t.dtype == torch.float32 for t in low)
    storages = {}
    for t in low:
        storages.setdefault(t.dtype, set()).add(storage_start(t))
    assert all(len(s) == 1 for s in storages.values()), storages
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in low)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all((t.data_ptr() - storage_start(t)) % 256 == 0 for t in low)

    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = gt.AdamW(resumed, lr=LR, weight_decay=WD, **form)
    again.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    run(params, opt, 3, device, start=1)
    run(resumed, again, 3, device, start=1)
    for p, q in zip(params, resumed):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's blocks are CUDA's")
@pytest.mark.parametrize("form", LOW_BIT_FORMS[2:], ids=lambda f: "int4 " + f.get("master", "float32"))
def test_first_step_allocates_what_the_4bit_state_counts(form):
    """The 4-bit forms' bounds (test_state_bytes_per_parameter) as the device sees them: the memory the first step leaves allocated,
    per parameter, over GPT-2-sized matrices (codes of 1.2 MB, which the caching allocator
    put in 2 MiB blocks when each was a tensor of its own)."""
    dtype = torch.bfloat16 if form.get("master") == "remainder" else torch.float32
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda").to(dtype))
              for s in [(768, 3072), (3072, 768), (768, 2304), (768, 768)] * 3]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device="cuda").to(dtype) * 0.01
    opt = gt.AdamW(params, lr=LR, **form)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    n = sum(p.numel() for p in params)
    allocated, counted = torch.cuda.memory_allocated() - before, opt.state_bytes()
    # Beyond what the state counts: each buffer (codes, absmax, remainders) rounded up to
    # torch's 2 MiB, and a 512-byte block for each step count and plan scalar.
    assert allocated - counted <= 3 * 2 ** 21 + 512 * 4 * len(params), (allocated / n, counted / n)
    assert allocated / n <= (3.1 if dtype == torch.bfloat16 else 1.1)


def test_bad_arguments_are_refused_naming_them():
    f32 = make_params("cpu")
    with pytest.raises(ValueError, match="moments is 'int2'"):
        gt.AdamW(f32, moments="int2")
    with pytest.raises(ValueError, match="amsgrad=True with moments='int4'"):
        gt.AdamW(f32, amsgrad=True, moments="int4")
    with pytest.raises(ValueError, match="min_4bit_size is -1"):
        gt.AdamW(f32, moments="int4", min_4bit_size=-1)
    with pytest.raises(ValueError, match="min_4bit_size is -1"):
        gt.Lamb(f32, moments="int4", min_4bit_size=-1)
    with pytest.raises(ValueError, match="master is 'half'"):
        gt.AdamW(f32, master="half")
    with pytest.raises(ValueError, match="amsgrad=True with moments='int8'"):
        gt.Adam(f32, amsgrad=True, moments="int8")
    with pytest.raises(TypeError, match="master='remainder'.*float32"):
        gt.AdamW(f32, master="remainder")
    with pytest.raises(TypeError, match="master='remainder'.*float16"):
        gt.AdamW(make_params("cpu", torch.float16), master="remainder")
    with pytest.raises(TypeError, match="float64 parameters take"):
        gt.AdamW(make_params("cpu", torch.float64), moments="int8")
    bf16 = make_params("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="moments='int8' with master='remainder'.*float moments"):
        gt.Lamb(bf16, moments="int8", master="remainder")
    with pytest.raises(ValueError, match="moments='int4' with master='remainder'"):
        gt.Lamb(bf16, moments="int4", master="remainder")
    with pytest.raises(TypeError, match="master='remainder'.*float32"):
        gt.Lamb(f32, master="remainder")
    with pytest.raises(TypeError, match="master='remainder'.*float16"):
        gt.Lamb(make_params("cpu", torch.float16), master="remainder")
    with pytest.raises(ValueError, match="master is 'half'"):
        gt.Lamb(bf16, master="half")
    with pytest.raises(ValueError, match="weight_remainder.*8- or 4-bit moments"):
        gradkit.LambPlan([bf16[0].detach()], [torch.zeros_like(bf16[0])], [torch.zeros(300, dtype=torch.uint8)],
                         [torch.zeros(300, dtype=torch.uint8)], [gradkit.LambHyperparameters()],
                         exp_avg_absmax=[torch.zeros(2)], exp_avg_sq_absmax=[torch.zeros(2)],
                         weight_remainder=[torch.zeros(300, dtype=torch.int16)])
    opt = gt.AdamW(f32, moments="int8", min_8bit_size=0)
    run(f32, opt, 1, "cpu")
    saved = opt.state_dict()
    del saved["state"][0]["exp_avg_absmax"]
    before = {k: v.clone() for k, v in opt.state[f32[0]].items()}
    with pytest.raises(ValueError, match="'exp_avg' is torch.uint8 without 'exp_avg_absmax'"):
        gt.AdamW(make_params("cpu"), moments="float32").load_state_dict(saved)
    assert all(torch.equal(before[k], v) for k, v in opt.state[f32[0]].items())


def test_small_parameters_keep_float32_moments(device):
    g = torch.Generator().manual_seed(5)
    big, small = (torch.nn.Parameter(torch.randn(n, generator=g).to(device)) for n in (5000, 4095))
    opt = gt.AdamW([big, small], lr=LR, moments="int8")  # min_8bit_size=4096, as bitsandbytes
    twin_small = torch.nn.Parameter(small.detach().clone())
    twin = gt.AdamW([twin_small], lr=LR)
    for s in range(5):
        big.grad, small.grad = torch.randn(5000, generator=g).to(device), torch.randn(4095, generator=g).to(device)
        twin_small.grad = small.grad.clone()
        opt.step()
        twin.step()
    assert opt.state[big]["exp_avg"].dtype == torch.uint8 and "exp_avg_absmax" in opt.state[big]
    assert opt.state[small]["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in opt.state[small]
    assert torch.equal(small.detach(), twin_small.detach())  # the float32 path, bit for bit
    assert opt.state_bytes() == 2 * 5000 + 8 * gradkit.quant_blocks(5000) + 8 * 4095
    with pytest.raises(ValueError, match="min_8bit_size is -1"):
        gt.AdamW([big], moments="int8", min_8bit_size=-1)


def test_a_deep_copy_keeps_the_state_form():
    params = make_params("cpu", torch.bfloat16)
    opt = gt.AdamW(params, moments="int8", min_8bit_size=0, master="remainder")
    run(params, opt, 2, "cpu")
    twin = copy.deepcopy(opt)
    assert (twin._form.moments, twin._form.master, twin._form.min_8bit_size) == ("int8", "remainder", 0)


STEPS = 300 if os.environ.get("GRADKIT_LONG_TESTS") else 30
MODES = [("int8", torch.float32, {"moments": "int8"}),
         ("int4", torch.float32, {"moments": "int4"}),
         ("bf16 int4 remainder", torch.bfloat16, {"moments": "int4", "master": "remainder"}),
         ("bf16 remainder", torch.bfloat16, {"master": "remainder"}),
         ("bf16 int8 remainder", torch.bfloat16, {"moments": "int8", "master": "remainder"})]


def train(kind, device, dtype, optimizer_class, **kwargs):
    """The losses of every step; for the CNN also its held-out accuracy at the end."""
    torch.manual_seed(0)
    if kind == "gpt":
        model, batches = models.TinyGPT(), models.text_batches
    else:
        if not models.fashion_mnist_available():
            pytest.skip(f"Fashion-MNIST not found in {models.FASHION_MNIST} (Debian: dataset-fashion-mnist)")
        model, batches = models.SmallCNN(), models.image_batches
    model = model.to(device=device, dtype=dtype)
    opt = optimizer_class(model.parameters(), lr=1e-3, weight_decay=0.01, **kwargs)
    losses = []
    for x, y in batches(device, STEPS):
        opt.zero_grad()
        loss = model(x.to(dtype) if x.is_floating_point() else x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    accuracy = models.held_out_accuracy(model, device, dtype) if kind == "cnn" else None
    return Run(np.array(losses), accuracy)


class Run(typing.NamedTuple):
    losses: np.ndarray
    accuracy: typing.Optional[float]

    def final(self):
        return self.losses[-min(TRAINING_WINDOW, STEPS):].mean()


_FLOAT32_RUNS = {}


def float32_runs(kind, device):
    """torch.optim.AdamW's and gradkit's float32 AdamW's runs (how far two float32 runs
    already drift apart by rounding), trained once per kind and device."""
    if (kind, device) not in _FLOAT32_RUNS:
        _FLOAT32_RUNS[kind, device] = tuple(train(kind, device, torch.float32, cls)
                                            for cls in (torch.optim.AdamW, gt.AdamW))
    return _FLOAT32_RUNS[kind, device]


def bfloat16_float32_master_run(kind, device):
    """A bfloat16 model stepped by gradkit's AdamW with a float32 master and float32
    moments: what the remainder forms replace. Trained once per kind and device."""
    if (kind, device, "bf16") not in _FLOAT32_RUNS:
        _FLOAT32_RUNS[kind, device, "bf16"] = train(kind, device, torch.bfloat16, gt.AdamW)
    return _FLOAT32_RUNS[kind, device, "bf16"]


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m[0])
def test_training_ends_near_float32_adamw(device, kind, mode):
    _, dtype, form = mode
    ours = train(kind, device, dtype, gt.AdamW, **form)
    want, gradkit_float32 = float32_runs(kind, device)
    final = ours.final()
    print(f"{mode[0]} {kind} on {device}, {STEPS} steps: final loss {final:.4f}, "
          f"{100 * (final / want.final() - 1):+.2f}% from torch.optim.AdamW's {want.final():.4f} "
          f"(gradkit float32: {100 * (gradkit_float32.final() / want.final() - 1):+.2f}%)")
    int4 = INT4_FINAL_LOSS if STEPS >= 300 else INT4_EARLY_FINAL_LOSS
    assert final <= want.final() * (1 + (int4 if "int4" in mode[0] else LOW_BIT_FINAL_LOSS))
    assert ours.losses[-5:].mean() < ours.losses[:5].mean()
    if kind == "cnn":
        # The accuracy is held against the same weights' dtype stepped with a float32
        # master and float32 moments (for bfloat16 weights, gradkit's float32-master
        # path): a bfloat16 model's forward costs accuracy whatever its optimizer keeps.
        same_dtype = want if dtype == torch.float32 else bfloat16_float32_master_run(kind, device)
        print(f"  held-out accuracy {100 * ours.accuracy:.2f}% against {100 * same_dtype.accuracy:.2f}% with a "
              f"float32 master and moments (torch.optim.AdamW float32: {100 * want.accuracy:.2f}%, gradkit "
              f"float32: {100 * gradkit_float32.accuracy:.2f}%)")
        # Only the long run is held to it: after 30 steps the accuracy still moves by
        # whole points from step to step.
        if STEPS >= 300:
            assert ours.accuracy >= same_dtype.accuracy - LOW_BIT_ACCURACY


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", [{"moments": "int8", "min_8bit_size": 0}, {"moments": "int4", "min_4bit_size": 0},
                                  {"moments": "int8", "master": "remainder"}], ids=str)
def test_cuda_steps_equal_cpu_steps_bit_for_bit_in_training(form):
    """The CNN trained on the CPU; a CUDA copy of its parameters stepped with the same
    gradients (copied over) stays bitwise equal to it, step after step."""
    if not models.fashion_mnist_available():
        pytest.skip(f"Fashion-MNIST not found in {models.FASHION_MNIST}")
    dtype = torch.bfloat16 if form.get("master") == "remainder" else torch.float32
    torch.manual_seed(0)
    model = models.SmallCNN().to(dtype)
    twins = [torch.nn.Parameter(p.detach().cuda()) for p in model.parameters()]
    opt = gt.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **form)
    twin_opt = gt.AdamW(twins, lr=1e-3, weight_decay=0.01, **form)
    for step, (x, y) in enumerate(models.image_batches("cpu", STEPS)):
        opt.zero_grad()
        model(x.to(dtype), y).backward()
        for p, t in zip(model.parameters(), twins):
            t.grad = p.grad.cuda()
        opt.step()
        twin_opt.step()
        for i, (p, t) in enumerate(zip(model.parameters(), twins)):
            assert torch.equal(p.detach(), t.detach().cpu()), f"params[{i}] differs after step {step}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes' 8-bit step needs CUDA")
@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_bitsandbytes_adamw8bit_beside_ours(kind):
    """The same training with bitsandbytes' AdamW8bit, where it is importable (scripts/gpu carry
    unpacks it into .data/pylibs): printed beside gradkit's 8-bit run, both held to the bound."""
    bnb = pytest.importorskip("bitsandbytes")
    want = float32_runs(kind, "cuda")[0].final()
    ours_run = train(kind, "cuda", torch.float32, gt.AdamW, moments="int8")
    theirs_run = train(kind, "cuda", torch.float32, bnb.optim.AdamW8bit)
    ours, theirs = ours_run.final(), theirs_run.final()
    print(f"{kind}, {STEPS} steps: gradkit int8 {100 * (ours / want - 1):+.2f}%, bitsandbytes "
          f"{bnb.__version__} AdamW8bit {100 * (theirs / want - 1):+.2f}% from torch.optim.AdamW's {want:.4f}")
    if kind == "cnn":
        print(f"  held-out accuracy: gradkit int8 {100 * ours_run.accuracy:.2f}%, bitsandbytes "
              f"{100 * theirs_run.accuracy:.2f}%")
    assert ours <= want * (1 + LOW_BIT_FINAL_LOSS)


@pytest.mark.parametrize("moments", ["int8", "int4"])
def test_lamb_with_low_bit_moments_follows_float32_lamb_and_resumes_bit_for_bit(device, moments):
    form = {"moments": moments, "min_8bit_size": 0, "min_4bit_size": 0}
    a, b = make_params(device), make_params(device)
    start = [p.detach().clone() for p in b]
    opt_a = gt.Lamb(a, lr=LR, weight_decay=WD, **form)
    opt_b = gt.Lamb(b, lr=LR, weight_decay=WD)
    run(a, opt_a, 10, device)
    run(b, opt_b, 10, device)
    assert opt_a.state[a[0]]["exp_avg"].dtype == torch.uint8
    if moments == "int4":
        assert opt_a.state[a[0]]["exp_avg"].numel() == gradkit.quant4_bytes(a[0].numel())
    # 10 steps of lr 1e-2 beside float32 LAMB's: the weights' movement differs by 2% with
    # int8 moments, 26-27% with int4 ones (measured; the C++ tests' Adam: 2%, 26%).
    for p, q, q0 in zip(a, b, start):
        if p.numel() > 1:
            rms = ((p - q).norm() / (q - q0).norm()).item()
            assert rms < (LAMB_INT4_MOVEMENT if moments == "int4" else 0.05), rms
    saved = copy.deepcopy(opt_a.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_r = gt.Lamb(resumed, lr=LR, weight_decay=WD, **form)
    opt_r.load_state_dict(saved)
    run(a, opt_a, 5, device, start=10)
    run(resumed, opt_r, 5, device, start=10)
    for p, q in zip(a, resumed):
        assert torch.equal(p.detach(), q.detach())
