"""gradkit.torch.OffloadedAdamW with release=True (each bucket's gradients freed on the
GPU once copied to the host), and gradients changed after their bucket was handed.

On a GPU, through real backward passes whose hooks hand and free the buckets:
- the weights equal gradkit.torch.AdamW's on the GPU bit for bit, with float32,
  bfloat16 and float16 weights, a tied embedding, and gradient accumulation over
  micro-batches (the sums kept on the host round as torch's on the GPU);
- with a loss scaler, clipping and injected Inf/NaN, AmpStep's steps and skips
  (the check runs on the host: the norm to rounding);
- p.grad is None after backward, and the peak of GPU memory drops by about the
  gradients' size;
- clip_grad_norm_ between backward and step(): applied (with max_norm, whose
  updates wait for the check) or a RuntimeError naming the remedy (without),
  never a silent wrong step;
- OffloadedLamb with release gives the weights it gives without, bit for bit.
On any machine: the argument check."""
import copy

import pytest

torch = pytest.importorskip("torch")
import gradkit  # noqa: E402
import gradkit.torch as gt  # noqa: E402
from conftest import cuda_visible  # noqa: E402
from models import TinyGPT, text_batches  # noqa: E402
from tolerances import HOST_CHECK  # noqa: E402

needs_cuda = pytest.mark.skipif(not cuda_visible(), reason="no CUDA device visible")
needs_hooks = pytest.mark.skipif(not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"),
                                 reason="the hooks need torch >= 2.1")


def test_release_needs_the_hooks():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    with pytest.raises(ValueError, match="release=True .* needs overlap=True"):
        gt.OffloadedAdamW(params, release=True, overlap=False)


def tiny_gpt(dtype, tied, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(layers=2, d=64).cuda()
    if tied:
        model.head.weight = model.tok.weight  # one parameter, two uses in each backward
    return model.to(dtype)


def train_side_by_side(dtype, make_offloaded, make_gpu, steps=6, micro=1, tied=False, clip=None):
    """`steps` steps of a seeded TinyGPT with make_offloaded(its parameters) and of its copy
    with make_gpu(...), each over `micro` micro-batches; `clip`: clip_grad_norm_ between
    backward and step() (both runs). Returns the two models and what was seen of p.grad."""
    model = tiny_gpt(dtype, tied)
    ref = copy.deepcopy(model)
    off, gpu = make_offloaded(model.parameters()), make_gpu(ref.parameters())
    batches = list(text_batches("cuda", steps * micro, batch=4, block=32))
    grads_left = 0
    for step in range(steps):
        for m, opt in ((model, off), (ref, gpu)):
            for x, y in batches[step * micro:(step + 1) * micro]:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
                    loss = m(x, y) / micro
                loss.backward()
            if opt is off:
                grads_left += sum(p.grad is not None for p in m.parameters())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, ref, off, grads_left


def assert_equal(model, ref):
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        assert torch.equal(p, q), f"parameter {i} differs"


@needs_cuda
@needs_hooks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("micro", [1, 3], ids=["one_backward", "three_micro_batches"])
def test_release_equals_the_gpu_step_bit_for_bit(dtype, micro):
    model, ref, off, grads_left = train_side_by_side(
        dtype, lambda p: gt.OffloadedAdamW(p, lr=3e-3, bucket_mb=0.05, release=True),
        lambda p: gt.AdamW(p, lr=3e-3), micro=micro)
    assert_equal(model, ref)
    assert grads_left == 0  # p.grad is None after every backward: every bucket was handed and freed
    assert off.native.releases_gradients


@needs_cuda
@needs_hooks
@pytest.mark.parametrize("micro", [1, 2], ids=["one_backward", "two_micro_batches"])
def test_release_with_a_tied_embedding(micro):
    model, ref, _, grads_left = train_side_by_side(
        torch.bfloat16, lambda p: gt.OffloadedAdamW(p, lr=3e-3, bucket_mb=0.05, release=True),
        lambda p: gt.AdamW(p, lr=3e-3), micro=micro, tied=True)
    assert_equal(model, ref)
    assert grads_left == 0


@needs_cuda
@needs_hooks
def test_release_with_clipping_and_a_scaler_equals_ampstep():
    """max_norm and a loss scaler with release: the check runs on the host over the staged
    gradients. Against AmpStep on the GPU: the same skips and scales, weights to rounding
    (the norm's float64 partial sums are added in another order)."""
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.5) for s in [(300, 70), (33,), (64, 8), (70000,)]]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    scaler = gradkit.LossScalerOptions(initial_scale=1024.0, growth_interval=3)
    off = gt.OffloadedAdamW(a, lr=1e-2, bucket_mb=0.1, piece_mb=0.05, loss_scaler=scaler, max_norm=0.05,
                            release=True)
    amp = gt.AmpStep(gt.AdamW(b, lr=1e-2), max_norm=0.05, init_scale=1024.0, growth_interval=3)
    skipped = 0
    for step in range(12):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        for (p, q) in zip(a, b):
            # A real backward (the hooks hand and free): the loss is linear, so p.grad is the target gradient.
            target = torch.randn(p.shape, device="cuda", generator=g) * 1e-2 * float(off.loss_scale)
            if step in (4, 9) and p.numel() == 33:
                target[3] = float("inf") if step == 4 else float("nan")
            (p * target).sum().backward()
            q.grad = target.clone()
        assert all(p.grad is None for p in a)
        off.step()
        amp.step()
        skipped += off.last_step_skipped
        assert float(off.loss_scale) == amp.get_scale(), step
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=HOST_CHECK[0], atol=HOST_CHECK[1])
    assert skipped == 2


@needs_cuda
@needs_hooks
def test_release_frees_the_gradients_during_backward():
    """The peak of GPU memory over a backward: without release it holds every gradient; with
    release, a few buckets of them."""
    def peak(release):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)]).cuda()
        opt = gt.OffloadedAdamW(model.parameters(), bucket_mb=4, release=release)
        x = torch.randn(64, 1024, device="cuda")
        for _ in range(2):  # the second step: the hooks hand buckets as backward makes them
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            model(x).square().mean().backward()
            torch.cuda.synchronize()
            high = torch.cuda.max_memory_allocated()
            opt.step()
            opt.zero_grad()
        del opt, model
        return high

    grad_bytes = 16 * 1024 * 1024 * 4
    kept, released = peak(False), peak(True)
    assert kept - released > 0.7 * grad_bytes, (kept, released)


@needs_cuda
@needs_hooks
def test_a_gradient_clipped_after_its_hand_raises_without_a_check():
    model = tiny_gpt(torch.float32, tied=False)
    opt = gt.OffloadedAdamW(model.parameters(), lr=3e-3, bucket_mb=0.05)
    for step, (x, y) in enumerate(text_batches("cuda", 2, batch=4, block=32)):
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == 0:
            opt.step()  # the first step hands every bucket in step(): the clipping applies
        else:
            with pytest.raises(RuntimeError, match=r"changed after .* max_norm= .* overlap=False"):
                opt.step()
        opt.zero_grad()


@needs_cuda
@needs_hooks
def test_a_gradient_clipped_after_its_hand_is_applied_with_a_check():
    """With max_norm, whose updates wait for the check in step(), a gradient clipped after its
    bucket was handed is copied again: the same weights as handing everything in step()."""
    def run(overlap):
        return train_side_by_side(
            torch.float32, lambda p: gt.OffloadedAdamW(p, lr=3e-3, bucket_mb=0.05, max_norm=1e9, overlap=overlap),
            lambda p: gt.AdamW(p, lr=3e-3), clip=0.05)[0]

    assert_equal(run(True), run(False))


@needs_cuda
@needs_hooks
@pytest.mark.parametrize("micro", [1, 2], ids=["one_backward", "two_micro_batches"])
def test_lamb_with_release_equals_lamb_without(micro):
    """OffloadedLamb: the sums kept on the host are the bits torch's accumulation on the GPU
    gives, so release changes no weight (LAMB's pieces hold whole tensors: a tied embedding's)."""
    model, ref, _, grads_left = train_side_by_side(
        torch.bfloat16, lambda p: gt.OffloadedLamb(p, lr=3e-3, weight_decay=0.01, bucket_mb=0.05, release=True),
        lambda p: gt.OffloadedLamb(p, lr=3e-3, weight_decay=0.01, bucket_mb=0.05), micro=micro, tied=True)
    assert_equal(model, ref)
    assert grads_left == 0
