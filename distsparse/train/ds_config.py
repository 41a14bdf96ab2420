"""Removed at merge: the old import path of distsparse.train.deepspeed.config, kept only for tools/ (another
branch moves them to bench/ and switches their imports)."""

from distsparse.train.deepspeed.config import build_ds_config, complete_ds_config, resolve_dtype  # noqa: F401
