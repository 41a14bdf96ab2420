"""Metrics: one dict per log step, grouped keys (`loss/`, `lr/`, `optim/`, `topology/`, `memory/`, `time/`),
written to TensorBoard on rank 0 and to nothing elsewhere (torchtitan's BaseLogger / TensorBoardLogger)."""

from __future__ import annotations

import resource
from typing import Protocol

import torch

from distsparse.utils import flatten_config


class MetricsWriter(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def hparams(self, config: dict, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class NullWriter:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def hparams(self, config: dict, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def hparams(self, config: dict, metrics: dict[str, float]) -> None:
        flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in flatten_config(config).items()}
        self.writer.add_hparams(flat, metrics, run_name=".")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def peak_memory_gb() -> float:
    """Peak GPU memory allocated, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
