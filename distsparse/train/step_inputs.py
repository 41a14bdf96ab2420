"""The next optimizer step's inputs, collated and sent to the device one step ahead (issue 25 item 3).

A pageable host tensor's `.to(cuda)` is a blocking copy: the host waits for the device to take it, so it can never
run ahead of the GPU. Here a step's micro-batches are collated on the host, pinned (CUDA only: pinned memory is
what lets the copy run asynchronously) and copied with `non_blocking=True`, while the previous step still runs.
Exactly one step is prefetched.

The sampler counts a global batch as consumed when its last micro-batch is handed out (data/sampler.py), so the
prefetched step is already counted there; `consumed_samples` here is what the optimizer steps have consumed, the
number a checkpoint records.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from distsparse.data import GlobalBatchSampler, collate

Batch = dict[str, torch.Tensor]


def should_pin(device: torch.device) -> bool:
    """Pin host batches only for a CUDA device: elsewhere the copy is synchronous anyway (CPU: no copy at all)."""
    return device.type == "cuda"


class StepInputs:
    """Hands out one optimizer step's micro-batches (on `device`) at a time, the next step's prepared ahead."""

    def __init__(self, dataset: torch.utils.data.Dataset, sampler: GlobalBatchSampler, device: torch.device,
                 pin: bool | None = None):
        self.dataset, self.sampler, self.device = dataset, sampler, torch.device(device)
        self.pin = should_pin(self.device) if pin is None else pin
        self._indices: Iterator[list[int]] | None = None   # started on first use: a resume sets the sampler first
        self._ready: list[Batch] | None = None

    def _to_device(self, batch: Batch) -> Batch:
        if self.pin:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def prefetch(self) -> None:
        """Collate the next step's micro-batches and start their copies (no-op when one step is already ready)."""
        if self._ready is not None:
            return
        if self._indices is None:
            self._indices = iter(self.sampler)
        self._ready = [self._to_device(collate(self.dataset, next(self._indices)))
                       for _ in range(self.sampler.grad_accum)]

    def next(self) -> list[Batch]:
        """This step's micro-batches; call `prefetch()` while the step runs to prepare the following one."""
        self.prefetch()
        batches, self._ready = self._ready, None
        return batches

    @property
    def consumed_samples(self) -> int:
        """Samples of the steps handed out so far (the sampler's count less a prefetched step)."""
        ahead = self.sampler.global_batch if self._ready is not None else 0
        return self.sampler.consumed_samples - ahead
