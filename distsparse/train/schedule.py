"""Learning-rate schedule: linear warmup, cosine decay to a minimum ratio (the GaLore/CHTs C4 recipe).

A pure function of the step, so resuming needs no scheduler state beyond the step (torchtitan's lesson).
"""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
