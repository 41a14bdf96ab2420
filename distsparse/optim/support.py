"""The two frames of a backbone matrix for the matrix rules: compressed values [out, k] on the active support,
and the dense [out, in] frame the Newton-Schulz geometry lives in.

`index` is the flat kept index (distsparse.nm.kept_index) of the current mask, or None for a dense matrix
(dense baselines: the mask is all ones, values are already [out, in] and both frames coincide).
Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

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
    """Root mean square over all entries, a 0-dim tensor (no host sync)."""
    return x.square().mean().sqrt()
