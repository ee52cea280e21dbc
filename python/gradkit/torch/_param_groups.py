"""From a torch optimizer's param groups to gradkit's hyperparameters, and the closure
torch's step() takes: what every optimizer of gradkit.torch (planned, sharded, offloaded)
does alike."""
import torch

import gradkit


def closure_loss(closure):
    """closure()'s loss, with gradients enabled (a step runs under no_grad), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def adam_hyperparameters(group, decay):
    """gradkit.AdamHyperparameters from a torch param group (lr, betas, eps, weight_decay, amsgrad,
    maximize) and the weight decay's form: every Adam-like optimizer here maps a group this way."""
    return gradkit.AdamHyperparameters(lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                       eps=group["eps"], weight_decay=group["weight_decay"], decay=decay,
                                       amsgrad=group["amsgrad"], maximize=group["maximize"])


def lamb_hyperparameters(group, max_norm):
    """gradkit.LambHyperparameters from a torch param group (betas, eps, weight_decay, min_trust,
    max_trust, bias_correction); `max_norm`: LAMB's own clipping threshold (0: none)."""
    return gradkit.LambHyperparameters(alpha=group["betas"][0], beta=group["betas"][1], lambda_=group["weight_decay"],
                                       epsilon=group["eps"], ratio_min=group["min_trust"],
                                       ratio_max=group["max_trust"], max_norm=max_norm,
                                       bias_correction=group["bias_correction"])
