"""gradkit: everything a training loop does between backward and the next forward.

The classes here are the C++ library's, one for one (tensors cross as DLPack
arrays, zero-copy, from torch, numpy or any DLPack producer). PyTorch users
want ``gradkit.torch``: optimizers that subclass ``torch.optim.Optimizer``,
the fused mixed-precision step, and flat gradients.
"""
from gradkit._shared_libraries import load_shared_libraries as _load_shared_libraries

_shared_libraries = _load_shared_libraries()  # before the module: its loads of NCCL and cuBLASLt then find torch's
from gradkit._gradkit import *  # noqa: E402,F401,F403

__version__ = "0.1.0"
