"""gradkit.torch.Muon over tensor-parallel, 2-D (FSDP x TP) and expert-parallel
meshes (ranks/muon_meshes.py under torchrun): the unsharded step's weights, bit for
bit on the CPU over gloo; experts that send nothing; heads cut off their
boundaries refused; a TP plan under fully_shard with accumulated micro-batches;
AmpStep's norm over those layouts (each element once) and one rank's Inf skipping all;
its state through torch.distributed.checkpoint saved on a 2 x 2 mesh and loaded on
a 1-D one. On a GPU machine over NCCL, a GPU per rank, or every rank on
GRADKIT_TEST_CUDA_DEVICE."""
import pytest

torch = pytest.importorskip("torch")
try:
    from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    from test_torch_fsdp2 import run
except Exception:  # no FSDP2 or tensor parallelism in this torch (test_torch_fsdp2 says why)
    pytest.skip(f"torch {torch.__version__} has no FSDP2 or tensor parallelism", allow_module_level=True)


def test_tensor_parallel_and_experts_on_2_ranks(tmp_path):
    run(2, "tp", tmp_path, script="muon_meshes.py")


@pytest.fixture(scope="module")
def mesh_checkpoint(tmp_path_factory):
    """The 2 x 2 mesh's run (4 ranks) and the state it saves."""
    directory = tmp_path_factory.mktemp("muon_meshes")
    run(4, "mesh2d", directory, script="muon_meshes.py")
    return directory


def test_two_dimensional_meshes_on_4_ranks(mesh_checkpoint):
    assert (mesh_checkpoint / "meshes_full.pt").exists()


def test_a_2x2_checkpoint_loads_on_a_1d_mesh(mesh_checkpoint):
    run(2, "load", mesh_checkpoint, script="muon_meshes.py")
