"""The shared libraries gradkit's native module shares with PyTorch, loaded
before it: the NCCL and the cuBLASLt of NVIDIA's wheels (nvidia-nccl-cu12/-cu13,
nvidia-cublas), which PyPI's torch installs, and torch's OpenMP runtime
(libgomp.so.1, which the module links by that name), where they are installed.

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

GRADKIT_NCCL_LIBRARY, GRADKIT_CUBLASLT_LIBRARY and GRADKIT_OPENMP_LIBRARY name other files to load
instead (the module's loader opens the same files); an empty value loads
none (the module then finds the system's by name). A file that does not
load here is left to the module, whose first use of it says why and how to
get it; importing gradkit never fails for want of either library."""
import ctypes
import glob
import importlib.util
import os

# Each library: the variable naming another file, the package whose folder holds it
# (the "nvidia" namespace package of NVIDIA's wheels, or torch), and where below it.
# OpenMP: the module needs libgomp.so.1 (the CPU kernels' threads), which the wheel
# does not carry, so that the process holds torch's one OpenMP runtime, not two.
_LIBRARIES = (
    ("GRADKIT_NCCL_LIBRARY", "nvidia", ("nccl/lib/libnccl.so.2",)),
    ("GRADKIT_CUBLASLT_LIBRARY", "nvidia", ("cublas/lib/libcublasLt.so.13", "cu13/lib/libcublasLt.so.13")),
    ("GRADKIT_OPENMP_LIBRARY", "torch", ("lib/libgomp.so.1",)),
)


def _package_roots(package):
    """The folders of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def wheel_library(relative_paths, package="nvidia"):
    """The path of the first of `relative_paths` found below an installed package, or None."""
    for root in _package_roots(package):
        for relative in relative_paths:
            found = glob.glob(os.path.join(root, relative))
            if found:
                return found[0]
    return None


def load_shared_libraries():
    """Loads the libraries to share (see the module's docstring); returns {variable: path}
    of those loaded."""
    loaded = {}
    for variable, package, relative_paths in _LIBRARIES:
        path = os.environ.get(variable)
        if path is None:
            path = wheel_library(relative_paths, package)
        if not path:
            continue
        try:
            ctypes.CDLL(path)
        except OSError:
            continue  # the module's loader reports it where the library is needed
        loaded[variable] = path
    return loaded
