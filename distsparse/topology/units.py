"""Refresh units of an N:M matrix: what a row group or a 4x4 block is in the dense [O, I] view.

A unit is what a refresh selects and re-patterns (DESIGN s5): a row group (4 consecutive input columns of one
output row, unit id r * I/4 + g, library `row_patterns(N)`) or, block-wise, a 4x4 block (unit id
bi * I/4 + bj, library `block_motifs(N)` flattened to 16 positions, row-major inside the block). Unit ids follow
the row-major order of the codes, so the same id names the same unit on every rank.
"""

from __future__ import annotations

import functools

import torch

from distsparse.nm import NMSpec, block_motifs, motif_ids, row_patterns

M = 4


def unit_size(spec: NMSpec) -> int:
    return M if spec.layout == "row" else M * M


def num_units(spec: NMSpec, shape: tuple[int, int]) -> int:
    return shape[0] * shape[1] // unit_size(spec)


def library(spec: NMSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [P, unit_size]: the legal patterns of one unit, in the library order the codes use."""
    if spec.layout == "row":
        return row_patterns(spec.n, device=device)
    return block_motifs(spec.n, device=device).view(-1, M * M)


def unit_magnitude(values: torch.Tensor, spec: NMSpec, shape: tuple[int, int]) -> torch.Tensor:
    """Mean |w| over the active links of every unit, [num_units]. `values` [O, K] in NMSparseLinear layout:
    row r keeps N values per 4 columns in column order, so group g of row r is values[r, g*N:(g+1)*N] and
    block (bi, bj) is rows 4bi..4bi+3 of those slices."""
    out_f, in_f = shape
    mag = values.abs()
    if spec.layout == "row":
        return mag.view(out_f * in_f // M, spec.n).mean(-1)
    return mag.view(out_f // M, M, in_f // M, spec.n).mean(dim=(1, 3)).reshape(-1)


def _block_coords(ids: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    per_row = shape[1] // M
    return ids // per_row, ids % per_row


def gather_units(x: torch.Tensor, ids: torch.Tensor, spec: NMSpec) -> torch.Tensor:
    """[B, unit_size] entries of the dense [O, I] tensor `x` at units `ids` [B]."""
    out_f, in_f = x.shape
    if spec.layout == "row":
        return x.view(-1, M)[ids]
    bi, bj = _block_coords(ids, (out_f, in_f))
    return x.view(out_f // M, M, in_f // M, M)[bi, :, bj, :].reshape(-1, M * M)


def scatter_units(x: torch.Tensor, ids: torch.Tensor, spec: NMSpec, src: torch.Tensor | bool) -> None:
    """Write `src` ([B, unit_size] or a scalar) into units `ids` of the dense [O, I] tensor `x`, in place."""
    out_f, in_f = x.shape
    if spec.layout == "row":
        x.view(-1, M)[ids] = src
        return
    bi, bj = _block_coords(ids, (out_f, in_f))
    if isinstance(src, torch.Tensor):
        src = src.view(-1, M, M)
    x.view(out_f // M, M, in_f // M, M)[bi, :, bj, :] = src


@functools.lru_cache(maxsize=None)
def _row_lookup(n: int) -> torch.Tensor:
    # 4-bit group key -> pattern id in row_patterns(n), -1 for an illegal group. Cached on the CPU whatever the
    # default device is; callers move it to their tensors' device.
    lut = torch.full((1 << M,), -1, dtype=torch.long, device="cpu")
    keys = (row_patterns(n, device="cpu").long() * (1 << torch.arange(M, device="cpu"))).sum(-1)
    lut[keys] = torch.arange(keys.numel(), device="cpu")
    return lut


def pattern_ids(bits: torch.Tensor, spec: NMSpec) -> torch.Tensor:
    """Library id (int64 [B]) of each unit's bool pattern [B, unit_size]; -1 where it is not legal."""
    if spec.layout == "block":
        return motif_ids(bits.view(-1, M, M), spec.n)
    keys = (bits.long() * (1 << torch.arange(M, device=bits.device))).sum(-1)
    return _row_lookup(spec.n).to(bits.device)[keys]
