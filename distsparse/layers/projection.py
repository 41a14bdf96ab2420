"""`SparseProjection`: one LLaMA projection when it carries more than its backbone matrix.

    y = branch(x, core(perm(x)))      core: NMSparseLinear | DenseLatentLinear | nn.Linear

The core is the matrix the engine owns; the branch (CoMoLoRA, LoRA, ...) and the input permutation train on
the DeepSpeed side. A projection with neither stays a bare core module, so plain models keep HF's names.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class SparseProjection(nn.Module):
    def __init__(self, core: nn.Module, branch: nn.Module | None = None, permutation: nn.Module | None = None):
        super().__init__()
        self.core, self.branch, self.permutation = core, branch, permutation
        self.in_features, self.out_features = core.in_features, core.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.core(self.permutation(x) if self.permutation is not None else x)
        return self.branch(x, y) if self.branch is not None else y


def backbone_core(module: nn.Module) -> nn.Module:
    """The engine-owned matrix module of a projection."""
    return module.core if isinstance(module, SparseProjection) else module
