"""The shared libraries gradkit's native module shares with PyTorch, loaded
before it: the NCCL and the cuBLASLt of NVIDIA's wheels (nvidia-nccl-cu12/-cu13,
nvidia-cublas), which PyPI's torch installs, where they are installed.

The module needs libnccl.so.2 (where it was built with NCCL) and
libcublasLt.so.13 (Muon's products, where it was built with CUDA). Loaded
first, it would find the system's, and torch, imported after it, would load
its own by path beside it (NCCL), or find the system's by its name in place
of the one it was built with (cuBLASLt). Loaded after this, the module finds
the wheel's by their names, and torch loads the same files again, which are
the same libraries. So whatever the order of imports, a process holds the one
NCCL and the one cuBLASLt that torch was built with (docs/python.md, "One
runtime of each"). torch itself is not imported. GRADKIT_NCCL_LIBRARY and
GRADKIT_CUBLASLT_LIBRARY name other files to load instead; an empty value
loads none (the system's is then found)."""
import ctypes
import glob
import importlib.util
import os

# Each library: the variable naming another file, and where NVIDIA's wheels put it
# (below a folder of the "nvidia" namespace package).
_LIBRARIES = (
    ("GRADKIT_NCCL_LIBRARY", ("nccl/lib/libnccl.so.2",)),
    ("GRADKIT_CUBLASLT_LIBRARY", ("cublas/lib/libcublasLt.so.13", "cu13/lib/libcublasLt.so.13")),
)


def _nvidia_roots():
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def wheel_library(relative_paths):
    """The path of the first of `relative_paths` found in an installed nvidia wheel, or None."""
    for root in _nvidia_roots():
        for relative in relative_paths:
            found = glob.glob(os.path.join(root, relative))
            if found:
                return found[0]
    return None


def load_shared_libraries():
    """Loads the libraries to share (see the module's docstring); returns {variable: path}
    of those loaded."""
    loaded = {}
    for variable, relative_paths in _LIBRARIES:
        path = os.environ.get(variable)
        if path is None:
            path = wheel_library(relative_paths)
        if path:
            ctypes.CDLL(path)
            loaded[variable] = path
    return loaded
