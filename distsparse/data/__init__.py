"""Token-shard dataset and resumable global-batch sampler (DESIGN s2, s6; decision 6)."""

from distsparse.data.dataset import IGNORE_INDEX, TokenDataset, load_meta
from distsparse.data.sampler import GlobalBatchSampler, collate, validation_batches

__all__ = ["IGNORE_INDEX", "GlobalBatchSampler", "TokenDataset", "collate", "load_meta", "validation_batches"]
