"""Learned input-channel permutations for one-shot N:M pruning (ShuffleSparse Algorithm 1, seed s3.3, App. E).

Owns the soft block-diagonal permutation of the pruning setting (frozen weights: only the permutation
trains), the Wanda/magnitude mask in permuted coordinates with its two straight-through estimators, and the
Adam loop of Algorithm 1. The caller (calibration.py) supplies the reconstruction loss as a closure, so the
same loop serves the per-layer objective and the whole-stack one. Self-contained on purpose: the training-time
`BlockPermutation` (distsparse/layers/permutation.py) is a module inside a sparse model; here a permutation is
a transient tensor over a frozen dense weight.

Index convention (research s9): a permutation is an int64 vector `perm` with Pi[i, perm[i]] = 1, so
Pi x = x[..., perm] and the weight in permuted coordinates is W_s = W Pi^T = W[:, perm]; the N:M groups are 4
consecutive columns of W_s. A soft block acts the same way: (A M^T)[:, i] = sum_j M[i, j] A[:, j].

One step of Algorithm 1 for every group g of linears sharing an input (q/k/v, gate/up, o, down):
  M_g      = Sinkhorn(|theta_g|)                      soft doubly stochastic blocks [nb, B, B]
  Pi_g     = Hungarian(M_g);  Mbar = M_g + sg(Pi_g - M_g)      (STE 1: the forward sees the hard Pi)
  A_s      = (|W| diag(s)) Mbar^T                     Wanda score in permuted coordinates (s = 1: magnitude)
  Z        = Zsoft + sg(topN(A_s) - Zsoft),  Zsoft = softmax over each 4-group of A_s / (tau * rowmean|A|)
                                                      (STE 2: the forward sees the hard top-N mask)
  W_eff    = W * (Z Mbar)                             the mask mapped back to the original columns
  loss     = L_rec(W_eff) + lambda_t * sum_g P(M_g) / (2 d_g)
lambda_t ramps linearly from 0 to lambda_max over the steps (seed Eq. 3); P is the AutoShuffleNet l1 - l2
penalty (seed Eq. 2) averaged per row and column. The forward value is exactly the hard pruned layer, so the
loss of each step is the loss of the permutation Hungarian decodes at that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment

from distsparse.nm import mask_from_scores

M = 4
OBJECTIVES = ("layer", "stack")
# Keeps every Sinkhorn denominator positive (an all-zero theta becomes the uniform block).
_FLOOR = 1e-12


@dataclass
class PermutationConfig:
    """Settings of the permutation learning (the CLI flag of each field is given in brackets)."""

    block_size: int = 64          # B: permutations are block-diagonal with B x B blocks [--perm-block]
    steps: int = 40               # Adam steps per layer (per model with objective 'stack') [--perm-steps]
    lr: float = 0.1               # Adam learning rate on theta [--perm-lr]
    lambda_max: float = 0.01      # penalty weight reached at the last step [--perm-lambda]
    temperature: float = 0.5      # tau of the soft top-N surrogate, relative to the row-mean score [--perm-temp]
    init_identity: float = 0.2    # theta0 = a I + (1 - a) J / B + noise: the first decode is the identity
    sinkhorn_iters: int = 5
    batch_size: int = 8           # calibration samples per Adam step [--perm-batch]
    objective: str = "layer"      # 'layer': cosine to the dense layer output; 'stack': to the dense model's
                                  # last hidden state, all layers learned jointly [--perm-objective]

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % M:
            raise ValueError(f"perm block_size (--perm-block): got {self.block_size}; "
                             f"allowed: a positive multiple of {M}")
        for key, flag in (("steps", "--perm-steps"), ("sinkhorn_iters", "sinkhorn_iters"),
                          ("batch_size", "--perm-batch")):
            if getattr(self, key) <= 0:
                raise ValueError(f"perm {key} ({flag}): got {getattr(self, key)}; allowed: a positive integer")
        for key, flag in (("lr", "--perm-lr"), ("temperature", "--perm-temp")):
            if not getattr(self, key) > 0:
                raise ValueError(f"perm {key} ({flag}): got {getattr(self, key)}; allowed: > 0")
        if self.lambda_max < 0:
            raise ValueError(f"perm lambda_max (--perm-lambda): got {self.lambda_max}; allowed: >= 0")
        if not 0.0 <= self.init_identity < 1.0:
            raise ValueError(f"perm init_identity: got {self.init_identity}; allowed: 0 <= a < 1")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"perm objective (--perm-objective): got {self.objective!r}; "
                             f"allowed: {', '.join(OBJECTIVES)}")

    def check_width(self, in_features: int, name: str) -> None:
        """Raise unless `in_features` splits into whole blocks."""
        if in_features % self.block_size:
            divisors = [b for b in range(M, min(in_features, 256) + 1, M) if in_features % b == 0]
            raise ValueError(f"perm block_size (--perm-block): got {self.block_size}, which does not divide "
                             f"{name}.in_features={in_features}; allowed for this width: {divisors}")


@dataclass
class PermGroup:
    """Linears that read one input and so share one permutation: names, frozen weights [out, d], and the
    per-column activation scales s [d] of each (ones for magnitude scores)."""

    key: str
    names: Sequence[str]
    weights: Sequence[torch.Tensor]
    scales: Sequence[torch.Tensor]

    @property
    def in_features(self) -> int:
        return self.weights[0].shape[1]


@dataclass
class LearnedPermutations:
    """Result of `learn_permutations`: one int64 permutation per group key, and the full-calibration
    reconstruction loss of the identity and of the learned permutations (the learned ones are returned
    only when they are no worse; `used_learned` says which)."""

    perms: dict[str, torch.Tensor]
    loss_identity: float
    loss_learned: float
    used_learned: bool
    moved_fraction: float


# ----------------------------------------------------------------------------------------------- tensor math

def sinkhorn(theta: torch.Tensor, num_iters: int) -> torch.Tensor:
    """fp32 [nb, B, B] approximately doubly stochastic blocks from any real theta (rows exact at the end)."""
    a = theta.float().abs() + _FLOOR
    for _ in range(num_iters):
        a = a / a.sum(-2, keepdim=True)
        a = a / a.sum(-1, keepdim=True)
    return a


def row_col_penalty(blocks: torch.Tensor) -> torch.Tensor:
    """Scalar AutoShuffleNet penalty sum over rows and columns of ||.||_1 - ||.||_2 (seed Eq. 2), divided by
    the 2 d rows and columns so it lies in [0, 1 - 1/sqrt(B)] for doubly stochastic blocks."""
    rows = blocks.abs().sum(-1) - torch.linalg.vector_norm(blocks, dim=-1)
    cols = blocks.abs().sum(-2) - torch.linalg.vector_norm(blocks, dim=-2)
    return (rows.sum() + cols.sum()) / (2 * blocks.shape[0] * blocks.shape[-1])


@torch.no_grad()
def hungarian(blocks: torch.Tensor) -> torch.Tensor:
    """int64 [nb * B] global permutation maximizing <Pi, M> block by block (seed Eq. 7), on the CPU."""
    num_blocks, size, _ = blocks.shape
    scores = blocks.detach().double().cpu().numpy()
    local = np.stack([linear_sum_assignment(block, maximize=True)[1] for block in scores])
    offsets = np.arange(num_blocks)[:, None] * size
    return torch.from_numpy(local + offsets).reshape(-1).to(torch.int64)


def hard_blocks(perm: torch.Tensor, block_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [nb, B, B] one-hot blocks with Pi[i, perm[i]] = 1 from a block-diagonal global permutation."""
    d = perm.numel()
    num_blocks = d // block_size
    base = torch.arange(num_blocks, device=perm.device).unsqueeze(1) * block_size
    local = (perm.view(num_blocks, block_size) - base).to(device)
    assert bool(((local >= 0) & (local < block_size)).all()), "permutation is not block-diagonal"
    return F.one_hot(local, block_size).float()


def random_block_permutation(d: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """int64 [d] uniformly random block-diagonal permutation (the paper's RandPerm control)."""
    blocks = [torch.randperm(block_size, generator=generator) + k * block_size for k in range(d // block_size)]
    return torch.cat(blocks)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """int64 [d] inv with inv[perm[i]] = i, so x[..., perm][..., inv] == x."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def to_permuted(a: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[out, d] A M^T for block-diagonal M [nb, B, B]: column i of the result is sum_j M[i, j] A[:, j]."""
    out_f, d = a.shape
    num_blocks, size, _ = blocks.shape
    return torch.einsum("okj,kij->oki", a.reshape(out_f, num_blocks, size), blocks).reshape(out_f, d)


def to_original(z: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[out, d] Z M: the inverse map of `to_permuted` when M is a permutation (M^T = M^-1)."""
    out_f, d = z.shape
    num_blocks, size, _ = blocks.shape
    return torch.einsum("oki,kij->okj", z.reshape(out_f, num_blocks, size), blocks).reshape(out_f, d)


def surrogate_mask(scores_perm: torch.Tensor, n: int, row_scale: torch.Tensor, temperature: float) -> torch.Tensor:
    """[out, d] hard top-n-of-4 mask in the forward, softmax over each group of 4 in the backward (STE 2).

    Scores are divided by their row mean (a constant under any in-row permutation) so `temperature` means the
    same thing for every layer, whatever the scale of its weights and activations.
    """
    hard = mask_from_scores(scores_perm.detach(), n, "row").to(scores_perm.dtype)
    logits = scores_perm / (temperature * row_scale)
    soft = logits.reshape(logits.shape[0], -1, M).softmax(-1).reshape_as(logits)
    return soft + (hard - soft).detach()


def pruned_by_permutation(weight: torch.Tensor, scale: torch.Tensor, perm: torch.Tensor, n: int) -> torch.Tensor:
    """[out, d] W with the n:4 score mask chosen in the coordinates of `perm`, in the original column order."""
    scores = weight.detach().float().abs() * scale.float()[None, :]
    mask_perm = mask_from_scores(scores[:, perm], n, "row")
    return weight * mask_perm[:, inverse_permutation(perm)].to(weight.dtype)


# ----------------------------------------------------------------------------------------------- learning loop

class _SoftPermutation(torch.nn.Module):
    def __init__(self, d: int, cfg: PermutationConfig, generator: torch.Generator, device: torch.device) -> None:
        super().__init__()
        size, a = cfg.block_size, cfg.init_identity
        eye = torch.eye(size).expand(d // size, size, size)
        noise = torch.rand(d // size, size, size, generator=generator) / size
        # Near-uniform plus a diagonal bump: Hungarian decodes the identity first (the 'none' baseline) while
        # the off-diagonal entries are close enough for a few dozen Adam steps to reorder them.
        self.theta = torch.nn.Parameter((a * eye + (1.0 - a) / size + 0.1 * (1.0 - a) * noise).to(device))
        self.sinkhorn_iters = cfg.sinkhorn_iters

    def soft(self) -> torch.Tensor:
        return sinkhorn(self.theta, self.sinkhorn_iters)


def _effective_weights(groups: Sequence[PermGroup], blocks_by_key: dict[str, torch.Tensor], n: int,
                       temperature: float) -> dict[str, torch.Tensor]:
    weights = {}
    for group in groups:
        blocks = blocks_by_key[group.key]
        for name, weight, scale in zip(group.names, group.weights, group.scales):
            scores = weight.detach().float().abs() * scale.float()[None, :]
            row_scale = scores.mean(-1, keepdim=True).clamp_min(1e-30)
            mask_perm = surrogate_mask(to_permuted(scores, blocks), n, row_scale, temperature)
            weights[name] = (weight.float() * to_original(mask_perm, blocks)).to(weight.dtype)
    return weights


def hard_weights(groups: Sequence[PermGroup], perms: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Every member weight pruned by its score mask in the coordinates of its group's permutation."""
    return {name: pruned_by_permutation(weight, scale, perms[group.key].to(weight.device), n)
            for group in groups for name, weight, scale in zip(group.names, group.weights, group.scales)}


def learn_permutations(groups: Sequence[PermGroup], loss_fn: Callable[[dict[str, torch.Tensor], int], torch.Tensor],
                       full_loss_fn: Callable[[dict[str, torch.Tensor]], float], n: int, cfg: PermutationConfig,
                       generator: torch.Generator) -> LearnedPermutations:
    """Algorithm 1 over `groups` (weights frozen), then final hardening by Hungarian.

    loss_fn(weights_by_name, step) -> differentiable reconstruction loss on the step's mini-batch;
    full_loss_fn(weights_by_name) -> the same loss over all calibration samples, used once for the identity and
    once for the learned permutations: the identity is kept if learning did not beat it (a cheap guard that the
    'learned' row of a comparison can never be worse than 'none' on the calibration objective).
    """
    for group in groups:
        cfg.check_width(group.in_features, group.names[0])
    device = groups[0].weights[0].device
    softs = {g.key: _SoftPermutation(g.in_features, cfg, generator, device) for g in groups}
    optimizer = torch.optim.Adam([p.theta for p in softs.values()], lr=cfg.lr)
    with torch.enable_grad():          # callers usually run under no_grad; only theta trains here
        for step in range(cfg.steps):
            lam = cfg.lambda_max * (step + 1) / cfg.steps
            soft = {key: module.soft() for key, module in softs.items()}
            bar = {key: s + (hard_blocks(hungarian(s), cfg.block_size, device) - s).detach()
                   for key, s in soft.items()}
            loss = loss_fn(_effective_weights(groups, bar, n, cfg.temperature), step)
            loss = loss + lam * sum(row_col_penalty(s) for s in soft.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    with torch.no_grad():
        learned = {key: hungarian(module.soft()) for key, module in softs.items()}
        identity = {g.key: torch.arange(g.in_features) for g in groups}
        loss_identity = full_loss_fn(hard_weights(groups, identity, n))
        loss_learned = full_loss_fn(hard_weights(groups, learned, n))
    used = loss_learned <= loss_identity
    perms = learned if used else identity
    moved = sum(int((p != torch.arange(p.numel())).sum()) for p in perms.values())
    total = sum(p.numel() for p in perms.values())
    return LearnedPermutations(perms, loss_identity, loss_learned, used, moved / total)


def cosine_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of 1 - cos(output, target) along the hidden dimension (PermLLM's L_rec)."""
    return (1.0 - F.cosine_similarity(output.float(), target.float(), dim=-1)).mean()
