"""Training scripts end without nanobind's leak reports: exit/one_process.py
(written as a new user would: everything at module level, losses and graphs
alive at exit) on every device. The multi-rank scripts are checked the same
way where they run: test_comm.py (mpiexec, the CPU) and
test_torch_distributed.py (torchrun, GPUs). Also what makes that hold with
any torch: the arrays over a GradientArena's or a LossScaler's memory keep
that memory alive, not the Python object."""
import gc
import os
import pathlib
import subprocess
import sys

import pytest

import gradkit
from exits import assert_clean_exit

SCRIPT = pathlib.Path(__file__).parent / "exit" / "one_process.py"


def test_a_training_script_exits_without_leak_reports(device):
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT), device], capture_output=True, text=True, timeout=300,
                          env=env)
    assert_clean_exit(done, 1)


def test_a_script_that_compiles_its_step_exits_0(device):
    """exit/compiled.py: exit status 0, its ": ok" line and no reports at exit
    (docs/python.md, "At exit": torch.compile's caches can keep a script's objects past
    the interpreter's clearing of its globals; gradkit lets go of them at exit)."""
    torch = pytest.importorskip("torch")
    from gradkit.torch import _compile
    if not _compile.AVAILABLE:
        pytest.skip(f"torch {torch.__version__} cannot compile gradkit's step (2.4+)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT.parent / "compiled.py"), device], capture_output=True,
                          text=True, timeout=300, env=env)
    assert_clean_exit(done, 1)


def test_arena_arrays_keep_the_memory_not_the_object(device):
    torch = pytest.importorskip("torch")
    arena = gradkit.GradientArena(device, gradkit.DType.f32, [3, 100, 1])
    refs = sys.getrefcount(arena)
    arrays = [*arena.gradients(), arena.flat(), arena.buffer()]
    tensors = [torch.from_dlpack(a) for a in arrays]
    assert sys.getrefcount(arena) == refs  # neither the arrays nor the tensors over them hold it
    del arena, arrays
    gc.collect()
    # The memory lives on with the tensors: written, read back through another view, zeroed by gradkit.
    values = torch.randn(100, generator=torch.Generator().manual_seed(3)).to(device)
    tensors[1].copy_(values)
    at = (tensors[1].data_ptr() - tensors[4].data_ptr()) // 4
    assert torch.equal(tensors[4][at:at + 100], values)
    gradkit.ZeroPlan([tensors[3]]).run()
    gradkit.synchronize(device)
    assert not tensors[1].any()


def test_loss_scaler_array_keeps_the_memory_not_the_object(device):
    torch = pytest.importorskip("torch")
    scaler = gradkit.LossScaler(device, gradkit.LossScalerOptions(initial_scale=8.0))
    refs = sys.getrefcount(scaler)
    scale = torch.from_dlpack(scaler.scale_device)
    assert sys.getrefcount(scaler) == refs
    del scaler
    gc.collect()
    assert scale.item() == 8.0
