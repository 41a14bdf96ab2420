"""The two frames of a backbone matrix for the matrix rules: compressed values [out, k] on the active support,
and the dense [out, in] frame the Newton-Schulz geometry lives in.

`index` is the flat kept index (distsparse.nm.kept_index) of the current mask, or None for a dense matrix
(dense baselines: the mask is all ones, values are already [out, in] and both frames coincide).
Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

import math

import torch

from distsparse.nm import gather_kept, scatter_kept


def to_dense(values: torch.Tensor, index: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """scatter(values): [out, in] with zeros off the support (a view of `values` when index is None)."""
    if index is None:
        return values.view(shape)
    return scatter_kept(values, index, shape)


def to_values(dense: torch.Tensor, index: torch.Tensor | None, kept_per_row: int) -> torch.Tensor:
    """gather(dense): the entries of [out, in] on the support, [out, k] (projection to the mask)."""
    if index is None:
        return dense
    return gather_kept(dense, index, kept_per_row)


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square over all entries, a 0-dim fp32 tensor (no host sync): one norm kernel accumulating in fp32,
    as rms_stacked (square then mean loses ~6e-6 relative over 700K fp32 entries, which the batched step would
    then differ by)."""
    return torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())


# ---- the same frames for a group of k same-shape matrices stacked [k, ...] (distsparse/optim/matrix_groups.py) ----

def to_dense_stacked(values: torch.Tensor, index: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """scatter per matrix: values [k, out, kk], int64 index [k, out * kk] (each row a flat kept_index) ->
    [k, out, in] with zeros off each support (a view of `values` when index is None)."""
    k = values.shape[0]
    if index is None:
        return values.view(k, *shape)
    dense = values.new_zeros(k, shape[0] * shape[1])
    return dense.scatter_(1, index, values.view(k, -1)).view(k, *shape)


def to_values_stacked(dense: torch.Tensor, index: torch.Tensor | None, values_shape: torch.Size) -> torch.Tensor:
    """gather per matrix: dense [k, out, in] -> the entries on each support, `values_shape` [k, out, kk]."""
    if index is None:
        return dense
    return dense.reshape(dense.shape[0], -1).gather(1, index).view(values_shape)


def rms_stacked(x: torch.Tensor) -> torch.Tensor:
    """Root mean square of each matrix of x [k, r, c]: fp32 [k, 1, 1] (no host sync). One norm kernel reading x
    once, accumulating in fp32 whatever x's dtype (a bf16 Newton-Schulz output), instead of square then mean."""
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    return norm / math.sqrt(x.shape[-2] * x.shape[-1])
