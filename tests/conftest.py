"""Shared test setup: CPU DeepSpeed, GPU-marked tests skipped with a reason where no CUDA device exists."""

import json
import os
import random

import pytest
import torch

from data_prep.prepare import PrepConfig, prepare

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
    from bench.ranks import RankPool
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


# Text for quality_corpus: a vocabulary a 300-piece tokenizer covers.
WORDS = ("the sparse matrix keeps one weight of every four in each row while the optimizer updates only "
         "active values and the topology engine removes weak links and regrows links chosen by the network "
         "paths of length three so the model learns which connections matter").split()


@pytest.fixture(scope="session")
def quality_corpus(tmp_path_factory):
    """A few KB of seeded text in 40 paragraph documents, prepared with a 300-piece tokenizer."""
    root = tmp_path_factory.mktemp("quality_corpus")
    rng = random.Random(0)
    for f in range(4):
        paragraphs = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(10)]
        (root / f"part{f}.txt").write_text("\n\n".join(paragraphs) + "\n")
    out = root / "prepared"
    prepare(PrepConfig(source=f"files:{root}/*.txt", out=out, vocab_size=300, val_fraction=0.25, num_proc=1,
                       seq_len=32))
    return out


@pytest.fixture
def fake_data(tmp_path):
    """A data directory with only meta.json: enough for tools that read the vocabulary and never train."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"vocab_size": 97, "source": "synthetic"}))
    return data
