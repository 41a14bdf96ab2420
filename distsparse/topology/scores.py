"""Cannistraci-Hebb link-prediction scores CH2-L3n and CH3-L3n on a bipartite mask [out, in].

Matrix form of research/cht_topology.md s1b (the node-based CHTs scores of the lab's
`_scores_for_regrowth_ch`), with u an output node (row), v an input node (column):

    C_out = A A^T   [O, O]    common input neighbours;  d_out = A 1   (fan-in of each output node)
    C_in  = A^T A   [I, I]    common output neighbours; d_in  = A^T 1 (fan-out of each input node)
    F[u, b] = (C[u, b] + 1[C > 0]) / (1 + max(d[b] - C[u, b] - 1, 0))     CH2: (1 + di) / (1 + de)
    F[u, b] =             1[C > 0]  / (1 + max(d[b] - C[u, b] - 1, 0))     CH3:       1  / (1 + de)
    S = F_out A + A F_in^T,   score = S * (1 - A)                           (candidates only)

(1 + max(x - 1, 0) is written max(x, 1).) Neither [O, O] nor [I, I] is ever materialized: the F_out A
term is computed for `chunk_size` rows of F_out at a time (from A[rows] A^T) and the A F_in^T term for
`chunk_size` columns (from A[:, cols]^T A), so the extra memory is A and S (fp32 [O, I] each) plus
O(chunk_size x max(O, I)) per chunk (research s6). Counts stay in fp32 (exact up to 2^24; bf16 would lose
counts above 256). Pure tensor function: no distributed code, no config objects.
"""

from __future__ import annotations

import torch

SCORE_VARIANTS = ("ch2", "ch3")


def _node_factor(common: torch.Tensor, degree: torch.Tensor, variant: str) -> torch.Tensor:
    """F for a chunk of seeds from common [c, D] (C[seed, z], overwritten) and degree [D] (of node z).

    Two [c, D] floats and one bool live at a time: F = (C + 1) / max(d - C, 1) (CH2) or 1 / max(d - C, 1)
    (CH3), zeroed where C = 0 (no path), which equals (C + 1[C > 0]) and 1[C > 0] over 1 + de.
    """
    no_path = common == 0
    # 1 + de with de = d[z] - C[seed, z] - 1 (z's link to the seed is neither internal nor external); the
    # clamp only acts where N(z) lies inside N(seed), z == seed included, and such terms never reach a
    # candidate (they need A[z, v] = 1 with C > 0, which forces d - C - 1 >= 0).
    denom = (degree.unsqueeze(0) - common).clamp_min_(1.0)
    if variant == "ch2":
        factor = common.add_(1.0).div_(denom)
    else:
        del common
        factor = denom.reciprocal_()
    return factor.masked_fill_(no_path, 0.0)


def ch_scores(mask: torch.Tensor, variant: str = "ch2", chunk_size: int = 512) -> torch.Tensor:
    """CH2-L3n (or CH3-L3n) scores fp32 [O, I] of every missing link of a bool mask [O, I]; 0 on links."""
    if variant not in SCORE_VARIANTS:
        raise ValueError(f"score: got {variant!r}; allowed: {', '.join(SCORE_VARIANTS)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: got {chunk_size}; allowed: an integer >= 1")
    if mask.dim() != 2:
        raise ValueError(f"mask: expected a 2-D [out, in] tensor, got shape {tuple(mask.shape)}")
    adj = mask.float()                                   # [O, I]
    out_f, in_f = adj.shape
    deg_out, deg_in = adj.sum(1), adj.sum(0)             # [O], [I]
    scores = torch.empty_like(adj)
    for start in range(0, out_f, chunk_size):            # S[rows] = F_out[rows] @ A
        rows = slice(start, start + chunk_size)
        factor = _node_factor(adj[rows] @ adj.T, deg_out, variant)        # [c, O]
        torch.mm(factor, adj, out=scores[rows])                            # [c, I]
    for start in range(0, in_f, chunk_size):             # S[:, cols] += A @ F_in[cols]^T
        cols = slice(start, start + chunk_size)
        factor = _node_factor(adj[:, cols].T @ adj, deg_in, variant)      # [c, I]
        scores[:, cols].addmm_(adj, factor.T)                              # [O, c]
    return scores.masked_fill_(mask.bool(), 0.0)
