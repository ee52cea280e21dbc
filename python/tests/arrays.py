"""Arrays on a device for the binding tests: numpy on the CPU (DLPack from
numpy), torch tensors on CUDA; read back as numpy."""
import numpy as np


def to_device(x, device):
    if device == "cpu":
        return np.array(x, copy=True, order="C")
    import torch
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def read(a):
    """numpy copy of a numpy array, a torch tensor or a gradkit-owned DLPack array."""
    if isinstance(a, np.ndarray):
        return a.copy()
    import torch
    if not isinstance(a, torch.Tensor):
        a = torch.from_dlpack(a)
    return a.detach().cpu().numpy()


def normal(rng, n, dtype=np.float32, scale=1.0):
    """Seeded normal values, never exactly zero."""
    x = rng.standard_normal(n) * scale
    x[x == 0] = scale
    return x.astype(dtype)
