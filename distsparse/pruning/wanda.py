"""Score-based one-shot N:M pruning: magnitude and Wanda (research/permutations_pruning.md s5, s8.B).

Owns the per-linear input statistic Wanda needs (squared column norms of the calibration inputs, gathered by
a forward hook) and the two saliencies S = |W| (magnitude) and S = |W| * ||X_j||_2 (Wanda, Sun et al. 2023),
compared within each row group of M consecutive input columns. N means kept everywhere in this package (the
reference code's `prune_n` is the number pruned; research s9). The calibration driver (calibration.py) owns
the layer loop; these are pure tensor functions plus one small accumulator.
"""

from __future__ import annotations

import torch

from distsparse.nm import mask_from_scores


class ColumnNormStats:
    """Forward-hook accumulator of sum_t x_tj^2 over every calibration token t of a linear's input.

    Wanda's reference keeps a running mean over samples (`scaler_row`); the mean differs from this sum by
    one positive constant, which no row-wise comparison sees, so the sum is kept in fp32 and the mean is
    `col_sq / num_samples`.
    """

    def __init__(self, in_features: int, device: torch.device | str) -> None:
        self.col_sq = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.num_samples = 0

    def add(self, x: torch.Tensor) -> None:
        """x [..., in]: one batch of inputs (the leading dimension counts samples)."""
        self.num_samples += x.shape[0] if x.dim() == 3 else 1
        self.col_sq += x.reshape(-1, x.shape[-1]).float().pow(2).sum(0)

    def col_norms(self) -> torch.Tensor:
        """[in] ||X_j||_2 / sqrt(num_samples): Wanda's sqrt(scaler_row)."""
        return (self.col_sq / max(1, self.num_samples)).sqrt()


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] |W|."""
    return weight.detach().float().abs()


def wanda_scores(weight: torch.Tensor, col_norms: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] |W_ij| * ||X_j||_2 (Wanda Eq. 1); col_norms [in]."""
    return weight.detach().float().abs() * col_norms.float()[None, :]


@torch.no_grad()
def prune_by_scores(weight: torch.Tensor, scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pruned weight, bool keep mask), both [out, in]: the n best scores of each row group of 4 columns."""
    mask = mask_from_scores(scores, n, "row")
    return weight * mask.to(weight.dtype), mask
