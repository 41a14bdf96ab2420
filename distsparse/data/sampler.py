"""Resumable global-batch sampler, validation sharding and collation.

Owns the training sample order. The order is a pure function of (seed, epoch) and the only state is
`consumed_samples` (DESIGN decision 6; Megatron's MegatronPretrainingSampler, research/pretraining_ecosystem.md
s2.1), so a run resumes exactly, also on another world size or gradient-accumulation split, as long as the global
batch G = micro_batch * grad_accum * world_size stays the same.

Layout of global batch b of an epoch with order `order`:

    order[b*G : (b+1)*G]  split into grad_accum * world_size micro-batches of micro_batch samples;
    micro-step a of rank r takes slice (a*world_size + r) * micro_batch + [0, micro_batch)

so the set of samples in a global batch depends neither on world_size nor on grad_accum. An epoch drops its
incomplete last global batch.

Consume the iterator in the training loop (with `collate`, or a DataLoader with num_workers=0): a prefetching
loader would advance `consumed_samples` ahead of the optimizer steps.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np
import torch


class GlobalBatchSampler:
    """Yields this rank's micro-batches (lists of sample indices) forever, epoch after epoch."""

    def __init__(self, num_samples: int, micro_batch: int, grad_accum: int, world_size: int, rank: int,
                 seed: int, consumed_samples: int = 0) -> None:
        for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
            if value < 1:
                raise ValueError(f"{name}: got {value}; allowed: >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: got {rank}; allowed: 0 <= rank < world_size ({world_size})")
        self.num_samples = num_samples
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.global_batch = micro_batch * grad_accum * world_size
        self.batches_per_epoch = num_samples // self.global_batch
        if self.batches_per_epoch == 0:
            raise ValueError(f"global batch (micro_batch * grad_accum * world_size = {self.global_batch}) exceeds "
                             f"the {num_samples} samples of the dataset; allowed: <= {num_samples}")
        self.consumed_samples = 0
        self.load_state_dict({"consumed_samples": consumed_samples})

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state["consumed_samples"])
        if consumed < 0 or consumed % self.global_batch:
            raise ValueError(f"consumed_samples: got {consumed}; allowed: a non-negative multiple of the global "
                             f"batch {self.global_batch} (resume with the same global batch size)")
        self.consumed_samples = consumed

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.global_batch // self.batches_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """int64 [num_samples]: the permutation of sample ids of `epoch` (a pure function of seed and epoch)."""
        # SeedSequence mixes (seed, epoch) into independent streams; a plain seed + epoch would make
        # (seed 0, epoch 1) and (seed 1, epoch 0) the same order.
        mixed = np.random.SeedSequence([self.seed, epoch]).generate_state(1, dtype=np.uint64)[0]
        generator = torch.Generator().manual_seed(int(mixed) & ((1 << 63) - 1))
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[int]]:
        cached_epoch, order = -1, None
        while True:
            step = self.consumed_samples // self.global_batch
            epoch, batch = divmod(step, self.batches_per_epoch)
            if epoch != cached_epoch:
                cached_epoch, order = epoch, self.epoch_order(epoch)
            start = batch * self.global_batch
            for micro_step in range(self.grad_accum):
                offset = start + (micro_step * self.world_size + self.rank) * self.micro_batch
                if micro_step == self.grad_accum - 1:
                    # Counted when the last micro-batch is handed out, so a checkpoint written right after this
                    # optimizer step records the global batch as consumed.
                    self.consumed_samples += self.global_batch
                yield order[offset: offset + self.micro_batch].tolist()


def validation_batches(num_samples: int, micro_batch: int, world_size: int, rank: int,
                       max_samples: int | None = None) -> list[list[int]]:
    """This rank's validation micro-batches: samples 0..n-1 (n = min(num_samples, max_samples)) cut into
    consecutive micro-batches (the last may be short), micro-batch j going to rank j % world_size.

    Every sample is evaluated exactly once across ranks, so a token-weighted sum over ranks is exact. Ranks
    may get one micro-batch more than others: reduce once after the loop, not per batch.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch: got {micro_batch}; allowed: >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank}; allowed: 0 <= rank < world_size ({world_size})")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples: got {max_samples}; allowed: >= 1 or None")
    total = num_samples if max_samples is None else min(num_samples, max_samples)
    starts = range(rank * micro_batch, total, world_size * micro_batch)
    return [list(range(start, min(start + micro_batch, total))) for start in starts]


def collate(dataset: torch.utils.data.Dataset, indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """Stack the samples `dataset[i]` for i in `indices` into one dict of [len(indices), ...] tensors."""
    samples = [dataset[i] for i in indices]
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
