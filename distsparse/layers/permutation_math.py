"""Pure tensor math of block-diagonal soft permutations (ShuffleSparse, seed s3.1-3.2; research s1, s8.A, s9).

Owns: the parameterization theta -> doubly stochastic blocks, the AutoShuffleNet l1 - l2 penalty, Hungarian
hardening, the lambda ramp, the distance-from-identity metric and index helpers. No nn.Module, no state,
no torch.distributed: `BlockPermutation` (permutation.py), export and one-shot pruning call these.

Index convention (research s9): a permutation is an int64 vector `perm` with Pi[i, perm[i]] = 1, so
y = Pi x is `x[..., perm]` (y_i = x_{perm[i]}); a soft block M acts the same way, y_i = sum_j M[i, j] x_j.
Block-diagonal permutations keep `perm[k*b:(k+1)*b]` inside `[k*b, (k+1)*b)`.

Shape legend: nb blocks of size b, d = nb * b.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

# Keeps every row and column sum of |theta| positive so no division is by zero (an all-zero theta becomes
# the uniform block). Next to entries of order one, the scale at which theta is initialized and trained, it
# is below fp32 resolution.
SINKHORN_FLOOR = 1e-12


def doubly_stochastic(theta: torch.Tensor, num_iters: int) -> torch.Tensor:
    """fp32 [..., b, b] doubly stochastic blocks from any real theta [..., b, b] (DESIGN decision 12).

    A = |theta| + floor; `num_iters` Sinkhorn rounds (columns, then rows) leave R exactly row-stochastic
    with column sums c. Sinkhorn converges only asymptotically, and slowly near a permutation (the state
    the penalty drives to: at b = 64, 20 rounds still leave column errors of 4e-3), so no fixed count can
    promise 1e-5. A closed-form last step makes the block exact instead, with c_max = max_j c_j >= 1:

        P_ij = (R_ij + (c_max - c_j) / b) / c_max

    rows: (1 + (b c_max - sum_j c_j) / b) / c_max = 1 because sum_j c_j = b; columns: (c_j + c_max - c_j)
    / c_max = 1; entries >= 0 because c_max >= c_j. It blends R toward the uniform block by the weight
    1 - 1/c_max, which vanishes as R converges, and is the identity map on an already doubly stochastic
    R. Row and column sums are then 1 up to the rounding of a b-term fp32 sum (below 1e-6 for b <= 128).
    The whole map is differentiable almost everywhere, so autograd trains theta through it.
    """
    assert num_iters >= 1, num_iters
    a = theta.float().abs() + SINKHORN_FLOOR
    for _ in range(num_iters):
        a = a / a.sum(-2, keepdim=True)
        a = a / a.sum(-1, keepdim=True)
    col = a.sum(-2, keepdim=True)                                   # [..., 1, b]
    col_max = col.amax(-1, keepdim=True)                            # [..., 1, 1]
    return (a + (col_max - col) / a.shape[-1]) / col_max


def l1_l2_penalty(blocks: torch.Tensor) -> torch.Tensor:
    """[...] AutoShuffleNet penalty per block (seed Eq. 2): sum over rows and columns of ||.||_1 - ||.||_2.

    Zero exactly on permutation matrices; for a doubly stochastic b x b block it lies in
    [0, 2b (1 - 1/sqrt(b))], the maximum at the uniform block (research s1).
    """
    rows = blocks.abs().sum(-1) - torch.linalg.vector_norm(blocks, dim=-1)
    cols = blocks.abs().sum(-2) - torch.linalg.vector_norm(blocks, dim=-2)
    return rows.sum(-1) + cols.sum(-1)


def per_row_penalty(blocks: torch.Tensor) -> torch.Tensor:
    """[...] the penalty averaged over the 2b rows and columns, in [0, 1 - 1/sqrt(b)] (the scale of delta,
    research s9: delta = 0.22 means the average row has l2 norm 0.78)."""
    return l1_l2_penalty(blocks) / (2 * blocks.shape[-1])


@torch.no_grad()
def hungarian(blocks: torch.Tensor) -> torch.Tensor:
    """int64 [nb, b] local column indices: per block the permutation maximizing <Pi, M> (seed Eq. 7).

    Solved in float64 on the CPU with scipy's linear_sum_assignment; every rank holding the same blocks
    gets the same answer. Row i of block k maps to column cols[k, i] (Pi[i, cols[k, i]] = 1).
    """
    scores = blocks.detach().double().cpu().numpy()
    cols = [linear_sum_assignment(block, maximize=True)[1] for block in scores]
    return torch.from_numpy(np.stack(cols)).to(torch.int64)


def block_offsets(local: torch.Tensor) -> torch.Tensor:
    """int64 [nb * b] global permutation from local indices [nb, b] (block k's indices shifted by k * b)."""
    num_blocks, block_size = local.shape
    base = torch.arange(num_blocks, device=local.device, dtype=torch.int64).unsqueeze(1) * block_size
    return (local + base).reshape(-1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """int64 [d] inv with inv[perm[i]] = i, so x[..., perm][..., inv] == x."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def permutation_matrix_from_indices(perm: torch.Tensor) -> torch.Tensor:
    """fp32 dense [d, d] Pi with Pi[i, perm[i]] = 1 (tests and small d only)."""
    d = perm.numel()
    eye = torch.zeros(d, d, device=perm.device)
    eye[torch.arange(d, device=perm.device), perm] = 1.0
    return eye


def distance_from_identity(perm: torch.Tensor) -> float:
    """1 - ||Pi - I||_F / sqrt(2N) for a hard permutation of size N (seed s5.3).

    ||Pi - I||_F^2 = 2 * (number of moved indices), so this is 1 - sqrt(moved / N): 1 at the identity,
    0 when every index moves. (The seed's sentence says lower values mean closer to the identity; its
    formula, used here, gives the opposite.)
    """
    moved = (perm != torch.arange(perm.numel(), device=perm.device)).sum().item()
    return 1.0 - math.sqrt(moved / perm.numel())


def perm_lambda(step: int, lambda_max: float, t_perm: int) -> float:
    """Penalty weight lambda_t, linear from 0 at step 0 to lambda_max at t_perm, then held (seed Eq. 3)."""
    if t_perm <= 0:
        raise ValueError(f"t_perm: got {t_perm}; allowed: a positive number of steps")
    if step < 0:
        raise ValueError(f"step: got {step}; allowed: step >= 0")
    return lambda_max * min(1.0, step / t_perm)
