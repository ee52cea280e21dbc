"""The communicator bindings on the CPU: python/tests/ranks/mpi_collectives.py
under mpiexec with 2, 3 and 4 ranks (MPI communicator, list collectives,
GradientArena, Adasum, checked mode, bad input), and
ranks/torch_ddp_cpu.py with 2 and 3 ranks (the DDP hooks and
all_reduce_gradients over the MPI communicator against DDP's default over
gloo), ranks/sharded_adamw.py with 2 and 3 ranks (ShardedAdamW against
DDP and torch.optim.AdamW), and ranks/train_to_exit.py with 2 (a script
written as a new user would). Every run must end without nanobind's leak
reports (exits.py). Skipped where gradkit was built without MPI
(gradkit.has_mpi_communicator()) or mpiexec is missing."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import gradkit
from exits import assert_clean_exit

SCRIPT = pathlib.Path(__file__).parent / "ranks" / "mpi_collectives.py"
_mpi_present = pytest.mark.skipif(not gradkit.has_mpi_communicator() or shutil.which("mpiexec") is None,
                                  reason="gradkit built without MPI, or no mpiexec")


def needs_mpi(test):
    """Marked `mpi` (scripts/test runs these against the build tree, which has MPI) and
    skipped where gradkit has no MPI or mpiexec is missing."""
    return pytest.mark.mpi(_mpi_present(test))


@pytest.mark.torch_free
@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_mpi_collectives_through_the_bindings(ranks):
    cmd = ["mpiexec", "-n", str(ranks), "--oversubscribe", "--allow-run-as-root", sys.executable, str(SCRIPT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert_clean_exit(done, ranks)


def run_torch_ranks(script, ranks, tmp_path):
    """`script` (in ranks/) under mpiexec with `ranks` ranks and torch; argv[1] a rendezvous file."""
    pytest.importorskip("torch")
    cmd = ["mpiexec", "-n", str(ranks), "--oversubscribe", "--allow-run-as-root", sys.executable,
           str(SCRIPT.parent / script), str(tmp_path / "rendezvous")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert_clean_exit(done, ranks)


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_hooks_over_the_mpi_communicator(ranks, tmp_path):
    run_torch_ranks("torch_ddp_cpu.py", ranks, tmp_path)


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_adamw_over_the_mpi_communicator(ranks, tmp_path):
    run_torch_ranks("sharded_adamw.py", ranks, tmp_path)


@needs_mpi
def test_a_training_script_over_mpi_exits_without_leak_reports(tmp_path):
    run_torch_ranks("train_to_exit.py", 2, tmp_path)


def test_from_process_group_needs_an_initialized_process_group():
    pytest.importorskip("torch")
    gtd = pytest.importorskip("gradkit.torch.distributed")
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gtd.from_process_group()


@pytest.mark.torch_free
def test_unique_id_arguments_are_checked():
    with pytest.raises(ValueError, match="unique_id"):
        gradkit.create_nccl_communicator(b"short", 0, 1)
    if not gradkit.has_nccl_communicator():
        with pytest.raises(RuntimeError, match="without NCCL"):
            gradkit.nccl_unique_id()
        return
    if gradkit.cuda_device_count() > 0:
        uid = gradkit.nccl_unique_id()
        assert isinstance(uid, bytes) and len(uid) == 128
    uid = bytes(128)  # the arguments are checked before NCCL sees the id
    with pytest.raises(ValueError, match="rank"):
        gradkit.create_nccl_communicator(uid, 3, 2)
    with pytest.raises(ValueError, match="size"):
        gradkit.create_nccl_communicator(uid, 0, 0)
    with pytest.raises(ValueError, match="timeout"):
        gradkit.create_nccl_communicator(uid, 0, 1, gradkit.CommunicatorOptions(timeout_s=0))


@pytest.mark.torch_free
def test_the_mpi_pieces_exist_exactly_where_gradkit_has_mpi():
    """A build without MPI still has the rest of the layer (the NCCL communicator from a
    unique id, the arena, Adasum, the sharded optimizers), and leaves the MPI pieces out."""
    for name in ("Communicator", "create_nccl_communicator", "nccl_unique_id", "GradientArena", "AdasumPlan",
                 "ShardedLayout", "ShardedAdam", "ShardedLamb"):
        assert hasattr(gradkit, name), name
    for name in ("create_mpi_communicator", "create_nccl_communicator_mpi", "MpiEnvironment"):
        assert hasattr(gradkit, name) == gradkit.has_mpi_communicator(), name


@pytest.mark.torch_free
def test_communicator_options_carry_blocking_calls():
    assert gradkit.CommunicatorOptions().blocking_calls is True
    options = gradkit.CommunicatorOptions(blocking_calls=False, timeout_s=5)
    assert options.blocking_calls is False and options.timeout_s == 5
    options.blocking_calls = True
    assert options.blocking_calls is True
