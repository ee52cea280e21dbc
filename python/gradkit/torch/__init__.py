"""gradkit for PyTorch: optimizers that subclass torch.optim.Optimizer, the
fused mixed-precision step, and flat gradients. Plain Python over gradkit's
classes: every number is computed by the C++ library, on the caller's
current CUDA stream. gradkit does not link against libtorch; tensors cross by
DLPack, zero-copy."""
from gradkit.torch.amp import AmpStep
from gradkit.torch.flat import FlatGradients, flat_gradients
from gradkit.torch.muon import Muon, muon_param_groups
from gradkit.torch.muon_adamw import MuonAdamW
from gradkit.torch.offload import OffloadedAdam, OffloadedAdamW, OffloadedLamb
from gradkit.torch.optim import Adam, AdamW, Lamb

__all__ = ["Adam", "AdamW", "Lamb", "Muon", "MuonAdamW", "muon_param_groups", "AmpStep", "FlatGradients", "flat_gradients", "OffloadedAdam", "OffloadedAdamW",
           "OffloadedLamb"]

import gradkit as _gradkit

if hasattr(_gradkit, "ShardedAdam"):  # built with the communication layer
    from gradkit.torch.sharded import ShardedAdamW
    __all__.append("ShardedAdamW")
