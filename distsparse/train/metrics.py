"""Metrics: one dict per log step, grouped keys (`loss/`, `lr/`, `optim/`, `topology/`, `memory/`, `time/`),
written on rank 0 to TensorBoard and, with `logging.wandb.mode` online or offline, to Weights & Biases, and to nothing
elsewhere (torchtitan's BaseLogger / TensorBoardLogger / WandBLogger)."""

from __future__ import annotations

import resource
import uuid
from pathlib import Path
from typing import Protocol

import torch

from distsparse.config import Config, config_to_dict
from distsparse.utils import flatten_config

WANDB_ID_FILE = "wandb_run_id"   # under train.out_dir: a resumed run continues the same W&B run


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


class WandbWriter:
    """One W&B run per training run: its id is kept in train.out_dir, so a resume (any world size) appends to it; a
    run that starts from step 0 takes a new id (an old run's steps would go backwards, which W&B drops)."""

    def __init__(self, cfg: Config, resumed: bool):
        import wandb
        out_dir = Path(cfg.train.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        id_file = out_dir / WANDB_ID_FILE
        if not resumed or not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12])   # W&B ids: [a-z0-9], unique per project
        w = cfg.logging.wandb
        self.run = wandb.init(project=w.project, name=w.name or None, mode=w.mode, dir=str(out_dir),
                              id=id_file.read_text().strip(), resume="allow", config=flatten_config(config_to_dict(cfg)))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def hparams(self, config: dict, metrics: dict[str, float]) -> None:
        self.run.summary.update(metrics)   # the config went to wandb.init

    def close(self) -> None:
        self.run.finish()


class FanOut:
    """Several writers as one."""

    def __init__(self, writers: list[MetricsWriter]):
        self.writers = writers

    def log(self, metrics: dict[str, float], step: int) -> None:
        for w in self.writers:
            w.log(metrics, step)

    def hparams(self, config: dict, metrics: dict[str, float]) -> None:
        for w in self.writers:
            w.hparams(config, metrics)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def build_writer(cfg: Config, rank: int, resumed: bool) -> MetricsWriter:
    """Rank 0: TensorBoard under <train.out_dir>/tb, plus W&B unless disabled (`resumed`: continue the W&B run of
    train.out_dir); other ranks: nothing."""
    if rank != 0:
        return NullWriter()
    writers: list[MetricsWriter] = [TensorBoardWriter(str(Path(cfg.train.out_dir) / "tb"))]
    if cfg.logging.wandb.mode != "disabled":
        writers.append(WandbWriter(cfg, resumed))
    return writers[0] if len(writers) == 1 else FanOut(writers)


def peak_memory_gb() -> float:
    """Peak GPU memory allocated, or the process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
