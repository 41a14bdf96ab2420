"""Token-shard dataset and resumable global-batch sampler (DESIGN s2, s6; decision 6).

The names below load on first use (PEP 562), so that data_prep's workers, which need only the numpy-only shard
format (`distsparse.data.shards`), do not import torch (seconds and about 300 MB per worker).
"""

import importlib

_EXPORTS = {"IGNORE_INDEX": "dataset", "TokenDataset": "dataset", "load_meta": "dataset",
            "GlobalBatchSampler": "sampler", "collate": "sampler", "validation_batches": "sampler"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'distsparse.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"distsparse.data.{_EXPORTS[name]}"), name)
