"""Shared fixtures: the devices to test on (CUDA only where a GPU is visible
to both gradkit and torch) and seeded random inputs."""
import os
import sys

import numpy as np
import pytest

import gradkit


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def cuda_visible():
    torch = _torch()
    return gradkit.cuda_device_count() > 0 and torch is not None and torch.cuda.is_available()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not cuda_visible(), reason="no CUDA device visible"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(20261122)


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: needs gradkit's MPI communicator (skipped in a build without MPI)")
    config.addinivalue_line("markers", "torch_free: needs no torch, only numpy and the module; its result does not "
                                       "depend on torch's version (scripts/test runs it under one torch)")


def pytest_report_header(config):
    torch = _torch()
    return (f"gradkit from {os.path.dirname(gradkit.__file__)}; python {sys.executable}; "
            f"torch {torch.__version__ if torch else 'not installed'}; "
            f"CUDA devices visible to gradkit: {gradkit.cuda_device_count()}")
