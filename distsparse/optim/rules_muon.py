"""`muon`: masked Muon on compressed values (the CHTs + Muon baseline; dense Muon when index is None).

KellerJordan/Muon `muon_update` (research/distributed_ns.md s3), restricted to the active support:
    M  = beta M + (1-beta) G                       (masked momentum: only the k kept entries per row exist)
    U  = (1-beta) G + beta M   (nesterov)  or  M
    O  = NS(scatter(U))                            (geometry of the [out, in] matrix, lower-dimensional side)
    theta = (1 - lr wd) theta - lr * max(1, out/in)^0.5 * gather(O)
gather(O) is the projection to the mask: NS output off the support is dropped. The shape scale is KellerJordan's
(and DeepSpeed's) sqrt(max(1, rows/cols)) with rows = out (weights are [out, in]); TANS instead uses the
fan ratio sqrt(out/in) (paper s3.2). State: fp32 `momentum` shaped like the master. In place.
Pure tensor functions: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

import torch

from distsparse.optim.hparams import MuonHParams
from distsparse.optim.newton_schulz import newton_schulz
from distsparse.optim.support import to_dense, to_values


def step_muon(master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
              hp: MuonHParams, index: torch.Tensor | None, shape: tuple[int, int]) -> None:
    momentum = state["momentum"]
    momentum.lerp_(grad, 1 - hp.momentum)
    update = grad.lerp(momentum, hp.momentum) if hp.nesterov else momentum
    ortho = newton_schulz(to_dense(update, index, shape), hp.ns_steps, hp.ns_coefficients)
    scale = max(1.0, shape[0] / shape[1]) ** 0.5
    master.mul_(1 - lr * hp.weight_decay).add_(to_values(ortho, index, master.shape[1]), alpha=-lr * scale)
