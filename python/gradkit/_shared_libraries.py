"""The shared libraries gradkit's native module shares with PyTorch, loaded
before it: the NCCL and the cuBLASLt of NVIDIA's wheels (nvidia-nccl-cu12/-cu13,
nvidia-cublas), which PyPI's torch installs, where they are installed.

The module does not link either: it loads libnccl.so.2 (the NCCL
communicator) and libcublasLt.so.13 (Muon's products on CUDA) by those
names at their first use, so that it imports, and its CPU steps run, where
neither is installed (src/cuda/library_loader.h). Loaded by name with
nothing loaded before, each would be the system's, and torch would load its
own by path beside it (NCCL), or find the system's in place of the one it
was built with (cuBLASLt). Loaded here first, by path, the wheel's copy is
the one the module's load by name finds, and torch loads the same files
again, which are the same libraries. So whatever the order of imports, a
process holds the one NCCL and the one cuBLASLt that torch was built with
(docs/python.md, "One runtime of each"). torch itself is not imported.

GRADKIT_NCCL_LIBRARY and GRADKIT_CUBLASLT_LIBRARY name other files to load
instead (the module's loader opens the same files); an empty value loads
none (the module then finds the system's by name). A file that does not
load here is left to the module, whose first use of it says why and how to
get it; importing gradkit never fails for want of either library."""
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
        if not path:
            continue
        try:
            ctypes.CDLL(path)
        except OSError:
            continue  # the module's loader reports it where the library is needed
        loaded[variable] = path
    return loaded
