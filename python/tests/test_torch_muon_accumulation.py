"""Muon with gradient accumulation: gradients summed over micro-batches are
orthogonalised once, at the one optimizer step, as the whole batch's are;
a Newton-Schulz per micro-batch (what a ZeRO engine that steps its
optimizer state per micro-batch does) gives another step, which the test
tells apart, so that it can fail."""
import copy

import torch

import gradkit.torch as gt


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 64, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(64, 32, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8, bias=False))


def batch(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 48, generator=g), torch.randn(n, 8, generator=g)


def recipe_muon(params):
    return gt.Muon(params, lr=0.02, weight_decay=0.01, ns_coefficients="polar_express", divisor="polar_express",
                   eps=1e-6, equilibrate_rows=True, renormalize=True, beta2=0.9, cautious_weight_decay=True)


def loss_of(net, x, y):
    return torch.nn.functional.mse_loss(net(x), y, reduction="sum")


def test_accumulated_micro_batches_take_one_newton_schulz_per_step():
    whole, accumulated, per_micro = model(1), model(1), model(1)
    opt_whole, opt_accumulated = recipe_muon(whole.parameters()), recipe_muon(accumulated.parameters())
    for step in range(3):
        x, y = batch(100 + step)
        # The whole batch at once.
        opt_whole.zero_grad()
        loss_of(whole, x, y).backward()
        opt_whole.step()
        # Four micro-batches, their gradients summed, one step.
        opt_accumulated.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4)):
            loss_of(accumulated, xm, ym).backward()
        opt_accumulated.step()
        for a, b in zip(whole.parameters(), accumulated.parameters()):
            # The same gradient up to the order of its sums: one bf16 Newton-Schulz of it.
            assert (a - b).norm() <= 1e-2 * a.norm(), f"step {step}"
    # One step per micro-batch (each on a quarter of the gradient) is another
    # trajectory: Newton-Schulz of a sum is not the sum of Newton-Schulzes.
    opt_micro = recipe_muon(per_micro.parameters())
    for step in range(3):
        x, y = batch(100 + step)
        for xm, ym in zip(x.chunk(4), y.chunk(4)):
            opt_micro.zero_grad()
            loss_of(per_micro, xm, ym).backward()
            opt_micro.step()
    apart = max(((a - b).norm() / a.norm()).item() for a, b in zip(whole.parameters(), per_micro.parameters()))
    assert apart > 5e-2, apart


def test_the_step_count_advances_once_per_step_not_per_micro_batch():
    net = model(2)
    opt = recipe_muon(net.parameters())
    x, y = batch(7)
    for xm, ym in zip(x.chunk(4), y.chunk(4)):
        loss_of(net, xm, ym).backward()
    opt.step()
    state = opt.state_dict()["state"]
    assert {int(s["step"]) for s in state.values() if "step" in s} <= {1}
    moments = [s["second_momentum_buffer"] for s in state.values() if "second_momentum_buffer" in s]
    assert len(moments) == 3 and all(torch.count_nonzero(m) > 0 for m in moments)
    copy.deepcopy(opt)  # the state is an ordinary optimizer's
