"""The real Trainer for a benchmark, built from `key=value` overrides as a run builds it (launch/pretrain.py), on
the DeepSpeed config every benchmark uses: configs/ds/zero2.json through `build_ds_config`."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DS_CONFIG = ROOT / "configs/ds/zero2.json"


def build_trainer(overrides: list[str], *, torch_adam: bool = False, bucket_elements: int | None = None):
    """A Trainer of `overrides`. `torch_adam`: torch's AdamW on the dense side (DeepSpeed's FusedAdam would first
    JIT-build its CUDA op, minutes); `bucket_elements`: ZeRO-2's reduce and all-gather bucket sizes."""
    import deepspeed  # noqa: F401  (imported before the trainer, as launch/pretrain.py does)

    from distsparse.config import load_config
    from distsparse.train.deepspeed.config import build_ds_config
    from distsparse.train.trainer import Trainer

    cfg = load_config(None, overrides)
    ds_config = build_ds_config(DS_CONFIG, cfg)
    if torch_adam:
        ds_config["optimizer"]["params"]["torch_adam"] = True
    if bucket_elements:
        ds_config["zero_optimization"].update(reduce_bucket_size=bucket_elements, allgather_bucket_size=bucket_elements)
    return Trainer(cfg, ds_config)
