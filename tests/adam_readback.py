"""The clip coefficient an Adam step applied, read back from the update it made (joint-clip tests).

With lr = eps = 1, no weight decay, and either the first bias-corrected step or beta1 = beta2 = 0, one step moves a
weight by d = -c g / (c |g| + 1), c the clip coefficient and g the mean gradient. That is c (g + d |g|) = -d for
every entry, solved for c by least squares over all of them.
"""

from __future__ import annotations

import torch


def applied_coefficient(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                        grads: dict[str, torch.Tensor], names: set[str]) -> float:
    num = den = 0.0
    for name in names:
        g, d = grads[name], (after[name] - before[name]).double()
        a = g + d * g.abs()
        num, den = num - float((d * a).sum()), den + float((a * a).sum())
    return num / den
