"""Legal N:M pattern libraries (M = 4).

Row-wise: a group is 4 consecutive input columns of one output row; a pattern keeps N of them, C(4, N)
patterns. Block-wise (transposable): a 4x4 block keeps N per row *and* N per column; 24 motifs at 1:4
(permutation matrices), 90 at 2:4 and 24 at 3:4 (complements of 1:4). research/cht_topology.md s4b.

Library order is fixed (lexicographic), because block codes are indices into it and live in checkpoints.
"""

from __future__ import annotations

import functools
import itertools

import torch

M = 4


@functools.lru_cache(maxsize=None)
def _row_patterns(n: int) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(i in kept for i in range(M)) for kept in itertools.combinations(range(M), n))


@functools.lru_cache(maxsize=None)
def _block_motifs(n: int) -> tuple[tuple[bool, ...], ...]:
    rows = _row_patterns(n)
    motifs = []
    for choice in itertools.product(rows, repeat=M):
        if all(sum(row[c] for row in choice) == n for c in range(M)):
            motifs.append(tuple(v for row in choice for v in row))
    return tuple(motifs)


def row_patterns(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [C(4, n), 4]: every way to keep n of 4 consecutive columns."""
    return torch.tensor(_row_patterns(n), dtype=torch.bool, device=device)


def block_motifs(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [P, 4, 4]: every 4x4 block with exactly n kept per row and per column."""
    return torch.tensor(_block_motifs(n), dtype=torch.bool, device=device).view(-1, M, M)


@functools.lru_cache(maxsize=None)
def _motif_lookup(n: int) -> torch.Tensor:
    # 16-bit block key -> motif id, or -1 when the block is not a legal motif.
    # Cached on the CPU whatever the default device is; callers move it to their tensors' device.
    lut = torch.full((1 << 16,), -1, dtype=torch.int16, device="cpu")
    weights = 1 << torch.arange(16, device="cpu")
    keys = (block_motifs(n, device="cpu").view(-1, 16).long() * weights).sum(-1)
    lut[keys] = torch.arange(keys.numel(), dtype=torch.int16, device="cpu")
    return lut


def motif_ids(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """Motif id (int64) of each bool block [..., 4, 4]; -1 where the block is not legal."""
    weights = 1 << torch.arange(16, device=blocks.device)
    keys = (blocks.reshape(*blocks.shape[:-2], 16).long() * weights).sum(-1)
    return _motif_lookup(n).to(blocks.device)[keys].long()
