"""Shared test setup: CPU DeepSpeed, GPU-marked tests skipped with a reason where no CUDA device exists."""

import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; run tools/gpu_check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks (OMP_NUM_THREADS=1) shared by every multi-rank test of the session."""
    from rankpool import RankPool
    pool = RankPool(2)
    yield pool
    pool.close()
