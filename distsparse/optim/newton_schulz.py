"""Newton-Schulz orthogonalization kernels (DESIGN s4 decision 7; research/distributed_ns.md s3).

Owns the quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T (paper s3.2, K = 5), its
coefficient sets and its FLOP count. Batched over leading dims of same-shape matrices (the matrix engine runs it once
per group of stacked matrices, distsparse/optim/matrix_groups.py). Always:
  - normalized in fp32 (a loss-scaled or large gradient must not overflow a half-precision cast),
  - iterated on the lower-dimensional side: the Gram matrix is min x min. A tall [m, n] (m > n) input runs the
    transposed iteration (KellerJordan/Muon, DeepSpeed `original_muon.py`) written untransposed, A = X^T X and
    X <- a X + X B (B is symmetric), so that no transposed copy is made,
  - iterated in `compute_dtype` (bf16 on CUDA, fp32 on CPU by default), returned in the input dtype.
`scatter` (the matrix engine's sparse groups, group_rules.py): G [..., r, c] holds only the kept values of sparse
matrices, one [r, c] per matrix (its norm is taken over the last two dims, so each matrix's values must be a matrix
there, not one flattened row of a 2-D G), and `scatter` builds the dense frame from them; the normalization runs
on the values (the zeros off the support add nothing to a Frobenius norm), the dense matrix is built directly in
`compute_dtype` and returned in it, so no fp32 copy of a full matrix is made (issue 25).
Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NSCoefficients:
    """One coefficient set: per-iteration (a, b, c) and the Frobenius-norm safety factor of the normalization.

    `per_step` holds one triple per iteration; `repeat_last` lets a one-triple set run any number of steps.
    """
    per_step: tuple[tuple[float, float, float], ...]
    norm_scale: float
    repeat_last: bool


COEFFICIENT_SETS: dict[str, NSCoefficients] = {
    # Polar Express (Amsel, Persson, Musco, Gower; arXiv 2505.16932), computed for 5 iterations with safety
    # factor 2e-2 and cushion 2; the table of karpathy/nanochat:nanochat/optim.py and
    # microsoft/dion:benchmark/polar_express.py. Each step is a different minimax polynomial, so the table
    # is only valid for at most 5 steps. Normalizing by 1.01 ||X||_F keeps the top singular value inside
    # the interval the polynomials were fitted on (DESIGN s5).
    "polar_express": NSCoefficients(
        per_step=(
            (8.156554524902461, -22.48329292557795, 15.878769915207462),
            (4.042929935166739, -2.808917465908714, 0.5000178451051316),
            (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
            (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
            (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        ),
        norm_scale=1.01,
        repeat_last=False,
    ),
    # KellerJordan quintic (KellerJordan/Muon:muon.py, DeepSpeed original_muon.py): one triple for every
    # step, chosen for the largest slope at 0; converges to U S' V^T with S' in about [0.5, 1.5].
    "kj_quintic": NSCoefficients(per_step=((3.4445, -4.7750, 2.0315),), norm_scale=1.0, repeat_last=True),
}


def coefficient_table(coefficients: str, steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of `steps` iterations; ValueError for an unknown set or too many steps."""
    if coefficients not in COEFFICIENT_SETS:
        raise ValueError(f"coefficients: got {coefficients!r}; allowed: {', '.join(COEFFICIENT_SETS)}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: got {steps!r}; allowed: an integer >= 1")
    spec = COEFFICIENT_SETS[coefficients]
    if spec.repeat_last:
        return spec.per_step + spec.per_step[-1:] * (steps - len(spec.per_step))
    if steps > len(spec.per_step):
        raise ValueError(f"steps: got {steps} for coefficients {coefficients!r}; allowed: 1..{len(spec.per_step)} "
                         f"(the table is fitted for {len(spec.per_step)} iterations)")
    return spec.per_step[:steps]


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients: str = "polar_express", eps: float = 1e-7,
                  compute_dtype: torch.dtype | None = None, *,
                  scatter: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Approximate polar factor U V^T of every matrix in G [..., m, n]; same shape and dtype as G (with `scatter`:
    the dense frame, in `compute_dtype`).

    X0 = G / (norm_scale * ||G||_F + eps) per matrix, in fp32, then `steps` quintic iterations in
    `compute_dtype` (default: bf16 on CUDA, fp32 elsewhere). `eps` keeps a zero matrix at zero.
    `scatter` (module docstring): G is the kept values, `scatter(X0)` the dense
    [..., m, n] in X0's dtype; the result is that dense frame in `compute_dtype`.
    """
    if G.dim() < 2:
        raise ValueError(f"G: expected [..., m, n] with at least 2 dims, got shape {tuple(G.shape)}")
    table = coefficient_table(coefficients, steps)
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if G.is_cuda else torch.float32
    X = G.float()
    norm = torch.linalg.matrix_norm(X, keepdim=True)   # Frobenius, one per matrix
    denominator = COEFFICIENT_SETS[coefficients].norm_scale * norm + eps
    # One division written in compute_dtype (computed in fp32, rounded once on the store)
    X = torch.div(X, denominator, out=torch.empty(X.shape, dtype=compute_dtype, device=X.device))
    if scatter is not None:
        X = scatter(X)
    frame = X.shape
    tall = frame[-2] > frame[-1]
    X = X.reshape(-1, *frame[-2:])   # one batch dim: a stacked group [k, m, n] is already one
    for a, b, c in table:
        # (b A + c A^2) and a X + B X as fused batched GEMMs (modded-nanogpt's form): 3 kernels per iteration
        A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)   # [batch, min, min]
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    X = X.view(frame)
    return X if scatter is not None else X.to(G.dtype)


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """FLOPs of `steps` iterations on an [m, n] matrix: steps * (4 s^2 l + 2 s^3), s = min(m, n), l = max.

    Per iteration: X X^T (2 s^2 l), A A (2 s^3), B X (2 s^2 l). DESIGN decision 2 uses this for LPT owners.
    """
    s, l = min(m, n), max(m, n)
    return steps * (4 * s * s * l + 2 * s ** 3)
