"""The branch's output magnitude for TensorBoard, per projection type (issue 28 item 2; CHTsNM paper s3.3).

For every projection with a branch, `branch/{projection}/output_rms_ratio_{mean,min,max}`: the RMS of what the
branch adds, y - y_sparse, over the RMS of the sparse core's output y_sparse, both over the logging step's tokens on
every rank (per matrix), then mean/min/max over the matrices of that projection type, e.g.
`branch/q_proj/output_rms_ratio_mean`. A method without a branch reports nothing.

Measured only on logging steps: `start()` installs forward hooks on the cores and their projections for that step's
micro-batches and `read()` removes them, so a steady step runs no extra op. The hooks add squared sums into one
float64 [matrices, 2] device tensor (no host read); `read()` sums it over ranks (one all-reduce) and reads it once.
Under activation checkpointing the recomputed forward adds the same values a second time to both sums, which leaves
every ratio unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsparse import dist as ddist
from distsparse.layers.branches import NoBranch
from distsparse.layers.projection import SparseProjection


class BranchProbe:
    def __init__(self, model: nn.Module):
        self.projections = {name: m for name, m in model.named_modules() if isinstance(m, SparseProjection)
                            and m.branch is not None and not isinstance(m.branch, NoBranch)}
        self._handles: list = []
        self._sums: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self._sums is not None

    def start(self) -> None:
        """Measure the forwards from now until `read()` (a logging step's micro-batches)."""
        if not self.projections or self.active:
            return
        device = next(next(iter(self.projections.values())).parameters()).device
        self._sums = torch.zeros(len(self.projections), 2, dtype=torch.float64, device=device)
        for row, module in enumerate(self.projections.values()):
            held: list[torch.Tensor] = []
            self._handles.append(module.core.register_forward_hook(
                lambda _m, _i, y_sparse, held=held: held.append(y_sparse.detach())))
            self._handles.append(module.register_forward_hook(self._accumulate(row, held)))

    def _accumulate(self, row: int, held: list[torch.Tensor]):
        def hook(_module, _inputs, y):
            y_sparse = held.pop().float()
            added = y.detach().float() - y_sparse
            self._sums[row] += torch.stack([added.square().sum(), y_sparse.square().sum()]).double()
        return hook

    def read(self) -> dict[str, float]:
        """Every rank calls it (one all-reduce) after `start()`; removes the hooks and returns the metrics."""
        if not self.active:
            return {}
        for handle in self._handles:
            handle.remove()
        sums, self._sums, self._handles = ddist.dist_sum(self._sums).tolist(), None, []   # the one read
        ratios: dict[str, list[float]] = {}
        for name, (added, backbone) in zip(self.projections, sums):
            ratio = (added / backbone) ** 0.5 if backbone > 0 else (0.0 if added == 0 else float("inf"))
            ratios.setdefault(name.rsplit(".", 1)[-1], []).append(ratio)
        out = {}
        for proj, values in sorted(ratios.items()):
            prefix = f"branch/{proj}/output_rms_ratio"
            out.update({f"{prefix}_mean": sum(values) / len(values), f"{prefix}_min": min(values),
                        f"{prefix}_max": max(values)})
        return out
