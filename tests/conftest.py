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


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module of tiny tensors: on a loaded 2-core VM a second OpenMP thread mostly
    waits for a scheduler time slice (measured 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks (OMP_NUM_THREADS=1) shared by every multi-rank test of the session."""
    from rankpool import RankPool
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    """An `srun` on PATH that does nothing: submitit's SLURM executor looks for one before writing sbatch files."""
    fake = tmp_path / "fake_bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\n")
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
