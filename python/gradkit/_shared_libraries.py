"""The shared libraries gradkit's native module shares with PyTorch, loaded
before it: the NCCL of NVIDIA's wheels (nvidia-nccl-cu12/-cu13, which
PyPI's torch installs), where one is installed.

The module needs libnccl.so.2 (where it was built with NCCL). Loaded first,
it would find the system's, and torch, imported after it, would load its
own by path beside it: two NCCLs in one process. Loaded after this, it
finds the wheel's by its name, and torch loads the same file again, which
is the same library. So whatever the order of imports, a process holds the
one NCCL that torch was built with (docs/python.md, "One runtime of each").
torch itself is not imported. GRADKIT_NCCL_LIBRARY names another file to
load instead; an empty value loads none (the system's is then found)."""
import ctypes
import importlib.util
import os


def wheel_nccl():
    """The path of libnccl.so.2 in an installed nvidia-nccl wheel, or None."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "nccl", "lib", "libnccl.so.2")
        if os.path.isfile(path):
            return path
    return None


def load_shared_libraries():
    """Loads the NCCL to share (see the module's docstring); returns its path or None."""
    path = os.environ.get("GRADKIT_NCCL_LIBRARY")
    if path is None:
        path = wheel_nccl()
    if not path:
        return None
    ctypes.CDLL(path)
    return path
