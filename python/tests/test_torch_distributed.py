"""gradkit.torch.distributed on 2 GPUs (skipped with fewer): the DDP hooks and
the loop without DDP against torch's DDP under torchrun
(ranks/torch_ddp.py), ShardedAdamW against DDP and torch.optim.AdamW
(ranks/sharded_adamw.py), a script written as a new user would
(ranks/train_to_exit.py), and a dead rank (ranks/dead_rank.py). The runs
that end normally must end without nanobind's leak reports (exits.py).

With GRADKIT_TEST_CUDA_DEVICE set, both ranks share that one GPU instead,
each posing as a host of its own to NCCL (scripts/ranks-on-one-gpu): the
results and faults are real, the speed is not."""
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import gradkit  # noqa: E402
from exits import assert_clean_exit  # noqa: E402

RANKS = pathlib.Path(__file__).parent / "ranks"
ONE_GPU = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ranks-on-one-gpu"
SHARED_GPU = os.environ.get("GRADKIT_TEST_CUDA_DEVICE") is not None
two_gpus = pytest.mark.skipif(
    not (torch.cuda.is_available()
         and (SHARED_GPU or torch.cuda.device_count() >= 2 and gradkit.cuda_device_count() >= 2)
         and hasattr(gradkit, "create_nccl_communicator") and gradkit.has_nccl_communicator()),
    reason="needs 2 GPUs (or GRADKIT_TEST_CUDA_DEVICE) and gradkit built with NCCL")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), NCCL_NVLS_ENABLE="0")


def rank_command(*args):
    """A rank's command line: with a shared GPU, through scripts/ranks-on-one-gpu."""
    return ([str(ONE_GPU)] if SHARED_GPU else []) + [sys.executable, *map(str, args)]


def torchrun(*args):
    """torchrun with 2 ranks on a free port, each running rank_command(*args)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
            "--no-python", *rank_command(*args)]


@two_gpus
def test_ddp_hooks_under_torchrun():
    cmd = torchrun(RANKS / "torch_ddp.py")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert_clean_exit(done, 2)


@two_gpus
def test_sharded_adamw_under_torchrun(tmp_path):
    cmd = torchrun(RANKS / "sharded_adamw.py", tmp_path / "sharded")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert_clean_exit(done, 2)


@two_gpus
def test_a_training_script_under_torchrun_exits_without_leak_reports():
    done = subprocess.run(torchrun(RANKS / "train_to_exit.py"), capture_output=True, text=True, timeout=600,
                          env=env())
    assert_clean_exit(done, 2)


@two_gpus
def test_a_dead_rank_ends_in_an_error_within_the_timeout():
    port = free_port()
    procs = []
    for rank in range(2):
        e = dict(env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(rank_command(RANKS / "dead_rank.py"), env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    out0, _ = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    assert procs[1].returncode == 3
    assert procs[0].returncode == 0, out0
    assert "error after" in out0, out0
    assert time.monotonic() - start < 90


@two_gpus
@pytest.mark.skipif(SHARED_GPU, reason="the example puts each rank on its own GPU")
def test_the_docs_torchrun_example_runs_as_written(tmp_path):
    import re
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"
    example = next(b for b in re.findall(r"```python\n(.*?)```", docs.read_text(), re.S) if "torchrun" not in b
                   and "from_process_group" in b)
    script = tmp_path / "example.py"
    script.write_text(example)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert_clean_exit(done)
    losses = [float(v) for v in re.findall(r"rank \d: loss (\S+)", done.stdout)]
    assert len(losses) == 2 and all(v < 0.05 for v in losses), done.stdout
