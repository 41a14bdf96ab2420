"""Which units a refresh selects: soft magnitude sampling (CHTs) or hard lowest-magnitude removal.

research/cht_topology.md s2a: CHTs keeps units with probability proportional to |w|^T, sampled without
replacement, and refreshes the rest; T is an exponent (schedule.temperature_at). torch.multinomial refuses more
than 2^24 categories, so the draw is the equivalent Gumbel-top-k race (research s3, [RECONSTRUCTION] there):
key = T log(m) + Gumbel, the `count` smallest keys are selected (the largest are kept). Working in log space
avoids m^9 underflow. Keys are float64 so a 2^24+ race has no ties in practice.
Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

import math

import torch

SELECTION_MODES = ("soft", "hard")
# The lab's clamp (`_soft_sample_keep_mask`): a zero-magnitude unit (e.g. regrown at zero) gets a finite
# log, so it is selected first but still ordered by its Gumbel draw, never by a tie.
MIN_MAGNITUDE = 1e-12


def selection_count(zeta: float, num: int) -> int:
    """round(zeta * num), halves rounded up (floor(zeta * num + 0.5)), computed in float64."""
    return min(num, int(math.floor(zeta * num + 0.5)))


def select_units(magnitude: torch.Tensor, count: int, *, temperature: float = 1.0, mode: str = "soft",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Ids (int64 [count], ascending) of the units selected for refresh out of `magnitude` [U].

    soft: the complement of a without-replacement sample of U - count units kept with probability
          proportional to magnitude^temperature; draws U uniforms from `generator` (on its device, so a CPU
          generator gives the same draw whatever device holds the weights).
    hard: the `count` smallest magnitudes, ties to the lower id; draws nothing.
    """
    if mode not in SELECTION_MODES:
        raise ValueError(f"selection: got {mode!r}; allowed: {', '.join(SELECTION_MODES)}")
    if not 0 <= count <= magnitude.numel():
        raise ValueError(f"count: got {count}; allowed: 0 <= count <= {magnitude.numel()} units")
    mag = magnitude.reshape(-1).double()
    if mode == "soft":
        device = generator.device if generator is not None else torch.device("cpu")
        uniform = torch.rand(mag.numel(), generator=generator, dtype=torch.float64, device=device)
        gumbel = -torch.log(-torch.log(uniform.clamp_min_(torch.finfo(torch.float64).tiny)))
        keys = temperature * torch.log(mag.clamp_min(MIN_MAGNITUDE)) + gumbel.to(mag.device)
    else:
        keys = mag
    return _lowest(keys, count)


def _lowest(keys: torch.Tensor, count: int) -> torch.Tensor:
    """Ids of the `count` smallest keys, ascending; ties at the threshold go to the lower ids. A selection
    (kthvalue) instead of a full sort: O(U) on the 2.8M groups of a 1B FFN matrix."""
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=keys.device)
    threshold = torch.kthvalue(keys, count).values
    chosen = keys < threshold
    ties = (keys == threshold).nonzero().view(-1)
    chosen[ties[: count - int(chosen.sum())]] = True
    return chosen.nonzero().view(-1)
