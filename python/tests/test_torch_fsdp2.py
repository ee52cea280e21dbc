"""gradkit.torch's optimizers and AmpStep over FSDP2's DTensor parameters
(ranks/fsdp2.py under torchrun; Muon's owner-rank step: ranks/fsdp2_muon.py): AdamW against torch.optim.AdamW, LAMB against
the unsharded model, AmpStep's norm against clip_grad_norm_ and a skip that
one rank's Inf decides for all, a Partial placement refused, and the state
through torch.distributed.checkpoint saved on 2 ranks and loaded on 4
(gradkit's and torch.optim's). On the CPU over gloo; on a GPU machine over
NCCL, a GPU per rank, or every rank on GRADKIT_TEST_CUDA_DEVICE."""
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.tensor import DTensor  # noqa: F401
except Exception:  # ImportError; Debian's torch 1.13 under Python 3.11 fails inside fsdp with a ValueError
    pytest.skip(f"torch {torch.__version__} has no FSDP2 (fully_shard) or public DTensor: they came in 2.6",
                allow_module_level=True)

from test_torch_distributed import RANKS, env, free_port, rank_command  # noqa: E402


def torchrun(ranks, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            str(free_port()), "--no-python", *rank_command(*args)]


def run(ranks, *args, script="fsdp2.py"):
    if torch.cuda.is_available() and os.environ.get("GRADKIT_TEST_CUDA_DEVICE") is None \
            and torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs (or GRADKIT_TEST_CUDA_DEVICE: the ranks share that one)")
    done = subprocess.run(torchrun(ranks, RANKS / script, *args), capture_output=True, text=True, timeout=900,
                          env=env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert done.stdout.count(": ok") == ranks, done.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The 2-rank run's checks, and the optimizer states it saves (gradkit's and torch's)."""
    directory = tmp_path_factory.mktemp("fsdp2")
    run(2, "train", directory)
    return directory


def test_fsdp2_on_2_ranks(checkpoints):
    assert (checkpoints / "full.pt").exists()


def test_fsdp2_checkpoints_load_on_4_ranks(checkpoints):
    run(4, "load", checkpoints)


@pytest.fixture(scope="module")
def muon_checkpoint(tmp_path_factory):
    """gradkit.torch.Muon's 2-rank run (ranks/fsdp2_muon.py) and the state it saves."""
    directory = tmp_path_factory.mktemp("fsdp2_muon")
    run(2, "train", directory, script="fsdp2_muon.py")
    return directory


def test_muon_on_2_ranks_is_the_unsharded_muon(muon_checkpoint):
    assert (muon_checkpoint / "muon_full.pt").exists()


def test_muon_checkpoint_loads_on_4_ranks(muon_checkpoint):
    run(4, "load", muon_checkpoint, script="fsdp2_muon.py")


def test_the_docs_fsdp2_example_runs_as_written(tmp_path):
    import pathlib
    import re
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"
    example = next(b for b in re.findall(r"```python\n(.*?)```", docs.read_text(), re.S) if "fully_shard(model)" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    cmd = torchrun(2, script) if not torch.cuda.is_available() else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(script)]
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("the example puts each rank on its own GPU")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"rank \d: fsdp2 loss (\d+\.\d{4})", done.stdout)]
    assert len(losses) == 2 and all(v < 0.1 for v in losses), done.stdout
