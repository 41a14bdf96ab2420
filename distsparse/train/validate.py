"""Cross-section checks of a run config, before any process group starts (DESIGN s6)."""

from __future__ import annotations

import importlib.util

from distsparse.checkpoint import check_resume
from distsparse.config import Config, check_backbone_shapes
from distsparse.data import TokenDataset, load_meta
from distsparse.data.dataset import SPLITS
from distsparse.train.batch import check_resume_position, resolve_batch, saved_batch
from distsparse.train.data_checks import check_data


def _check_positions(cfg: Config) -> None:
    """data.seq_len within the model's position table (with or without the data here)."""
    if cfg.data.seq_len > cfg.model.max_position_embeddings:
        raise ValueError(f"data.seq_len: got {cfg.data.seq_len}; allowed: <= model.max_position_embeddings "
                         f"({cfg.model.max_position_embeddings})")


def validate_without_data(cfg: Config, world_size: int) -> dict:
    """The checks that need no data, for a `--dry-run` planning a run whose data.dir is not on this machine (a
    laptop planning a cluster run): the batch plan at `world_size` and the backbone's shapes; the vocabulary must
    be stated (model.vocab_size). Returns a stand-in meta with that vocabulary."""
    if not cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size: got 0 and data.dir {cfg.data.dir!r} has no meta.json here; allowed: "
                         f"the data's vocabulary size (e.g. model.vocab_size=32000), or a data.dir that exists")
    _check_positions(cfg)
    check_backbone_shapes(cfg.model, cfg.method)
    resolve_batch(cfg.train, world_size)
    return {"vocab_size": cfg.model.vocab_size}


def validate(cfg: Config, world_size: int = 1) -> dict:
    """Raise ValueError naming key, value and what is allowed; return the data's meta.json. `world_size`: the
    ranks the run will have (the batch plan is resolved for it, with the checkpoint it resumes, and its global
    batch checked against the data)."""
    meta = load_meta(cfg.data.dir, key="data.dir")
    if cfg.model.vocab_size and meta["vocab_size"] > cfg.model.vocab_size:
        raise ValueError(f"model.vocab_size: got {cfg.model.vocab_size}; the data in {cfg.data.dir} has vocab "
                         f"{meta['vocab_size']}; allowed: >= {meta['vocab_size']} (or 0 to take it from the data)")
    _check_positions(cfg)
    if meta["mode"] == "truncate_pad" and cfg.data.seq_len != meta["seq_len"]:
        raise ValueError(f"data.seq_len: got {cfg.data.seq_len}; data in {cfg.data.dir} is truncate_pad at "
                         f"{meta['seq_len']}; allowed: {meta['seq_len']}")
    check_backbone_shapes(cfg.model, cfg.method)
    if cfg.logging.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ValueError(f"logging.wandb.mode: got {cfg.logging.wandb.mode!r}, but wandb is not installed; allowed: "
                         f"disabled, or install it (pip install wandb, the project's `wandb` extra)")
    manifest = check_resume(cfg, meta)
    saved = saved_batch(manifest) if manifest else None
    plan = resolve_batch(cfg.train, world_size, saved)
    if manifest:
        check_resume_position(plan, saved, int(manifest["consumed_samples"]), cfg.train)
    # the shards exist, have meta.json's sizes and hold a sample at data.seq_len
    datasets = {split: TokenDataset(cfg.data.dir, split, cfg.data.seq_len) for split in SPLITS}
    check_data(cfg, meta, plan=plan, num_train_samples=len(datasets["train"]))
    return meta
