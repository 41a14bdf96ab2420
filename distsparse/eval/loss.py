"""Token-weighted validation loss and perplexity (not the mean of per-batch means: research/
pretraining_ecosystem.md s1.3 explains why that differs). Pure functions of (model, batches): the trainer's
evaluation and the perplexity command both use them."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def loss_sums(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]],
              device: torch.device | str = "cpu") -> tuple[float, int]:
    """(sum of next-token cross-entropies, number of scored tokens) over `batches`; labels -100 are skipped."""
    total, count = 0.0, 0
    for batch in batches:
        input_ids = batch["input_ids"].to(device)
        labels = batch["labels"].to(device)
        logits = model(input_ids=input_ids).logits
        targets = labels[:, 1:]
        total += float(F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       targets.reshape(-1), ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    return total, count


def perplexity(total_loss: float, num_tokens: int) -> tuple[float, float]:
    """(mean loss, PPL) from summed losses; PPL is capped at exp(50) to stay finite in logs."""
    mean = total_loss / max(1, num_tokens)
    return mean, math.exp(min(mean, 50.0))
