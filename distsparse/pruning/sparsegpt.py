"""SparseGPT one-shot N:M pruning with OBS column updates (Frantar & Alistarh 2023; research s5, s8.C).

Owns the per-linear Hessian accumulator H = 2 X X^T / n (a forward hook feeds it) and `sparsegpt_prune`, a
transcription of `IST-DASLab/sparsegpt : sparsegpt.py : SparseGPT.fasterprune` for N:M: dead columns zeroed,
damping `percdamp * mean(diag H)`, the upper Cholesky factor U of H^-1, columns swept in blocks of
`blocksize`; at every 4th column of a block the N:4 mask of the next 4 columns is chosen from the OBS
saliency w^2 / U_jj^2 of the *already updated* weights; each pruned column's error is spread over the
columns to its right inside the block, and lazily onto the rest after the block. N means kept here (the
reference's `prunen` counts pruned ones; research s9). Pure tensor functions plus one accumulator.
"""

from __future__ import annotations

import torch

from distsparse.nm import mask_from_scores

M = 4


class HessianStats:
    """Forward-hook accumulator of sum_t x_t x_t^T (fp32 [in, in]) over the calibration tokens."""

    def __init__(self, in_features: int, device: torch.device | str) -> None:
        self.xxt = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.num_samples = 0

    def add(self, x: torch.Tensor) -> None:
        """x [..., in]: one batch of inputs (the leading dimension counts samples)."""
        self.num_samples += x.shape[0] if x.dim() == 3 else 1
        flat = x.reshape(-1, x.shape[-1]).float()
        self.xxt.addmm_(flat.T, flat)

    def hessian(self) -> torch.Tensor:
        """[in, in] H = 2 X X^T / num_samples, the reference's scaling (sample count, not token count)."""
        return self.xxt * (2.0 / max(1, self.num_samples))

    def col_norms(self) -> torch.Tensor:
        """[in] ||X_j||_2 / sqrt(num_samples), the Wanda statistic, read off the diagonal."""
        return (self.xxt.diagonal() / max(1, self.num_samples)).sqrt()


@torch.no_grad()
def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, n: int, blocksize: int = 128,
                    percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """(pruned weight in `weight.dtype`, bool keep mask), both [out, in], for row-wise n:4.

    Computes in float64 when `hessian` is float64 (tests compare against a float64 reference), else fp32
    as the reference does. Every group of 4 columns keeps exactly n entries of the mask; a kept weight can
    still come out exactly zero after the OBS updates, so callers check the mask, not the nonzeros.
    """
    if blocksize <= 0 or blocksize % M:
        raise ValueError(f"blocksize: got {blocksize}; allowed: a positive multiple of {M}")
    if not 0.0 <= percdamp < 1.0:
        raise ValueError(f"percdamp: got {percdamp}; allowed: 0 <= percdamp < 1")
    work = torch.promote_types(hessian.dtype, torch.float32)
    W = weight.detach().to(work).clone()
    H = hessian.detach().to(work).clone()
    rows, cols = W.shape
    assert H.shape == (cols, cols), (H.shape, W.shape)

    dead = H.diagonal() == 0          # columns never excited by the calibration data
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(percdamp * H.diagonal().mean())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    mask = torch.zeros(rows, cols, dtype=torch.bool, device=W.device)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        keep1 = mask[:, i1:i2]
        for i in range(i2 - i1):
            if i % M == 0:
                saliency = W1[:, i:i + M] ** 2 / Hinv1.diagonal()[i:i + M][None, :] ** 2
                keep1[:, i:i + M] = mask_from_scores(saliency, n, "row")
            w = W1[:, i]
            d = Hinv1[i, i]
            q = w * keep1[:, i]
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return W.to(weight.dtype), mask
