"""Element-wise rules: `adam`, `adamw` (torch.optim.Adam / AdamW semantics) and CAST's `adams`.

On compressed values [out, k] these are exactly Adam on the active entries (index and shape are not needed;
they are accepted so every rule has one signature). State: fp32 `exp_avg`, `exp_avg_sq` shaped like the
master and a 0-dim int64 CPU `step` counter. Updates happen in place on master and state.
Pure tensor functions: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

import torch

from distsparse.optim.hparams import AdamHParams, AdamSHParams


def _adam_core(master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], lr: float,
               hp: AdamHParams) -> None:
    """Moments, bias correction and the step, in torch.optim.Adam's order of operations."""
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    step = int(state["step"])
    exp_avg.lerp_(grad, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
    bias1 = 1 - hp.beta1 ** step
    bias2_sqrt = (1 - hp.beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(hp.eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias1)


def step_adam(master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
              hp: AdamHParams, index: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """torch.optim.Adam: weight_decay is L2 (added to the gradient before the moments)."""
    if hp.weight_decay:
        grad = grad.add(master, alpha=hp.weight_decay)
    _adam_core(master, grad, state, lr, hp)


def step_adamw(master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
               hp: AdamHParams, index: torch.Tensor | None, shape: tuple[int, int]) -> None:
    """torch.optim.AdamW: decoupled decay theta *= 1 - lr wd, then Adam."""
    master.mul_(1 - lr * hp.weight_decay)
    _adam_core(master, grad, state, lr, hp)


def step_adams(master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
               hp: AdamSHParams, index: torch.Tensor | None, shape: tuple[int, int], mask: torch.Tensor) -> None:
    """CAST's AdamS on a dense latent weight [out, in]; `mask` (bool [out, in]) marks the current N:M support.

    CAST has no public code (research/permutations_pruning.md s7); this follows its predecessor AST
    (thu-ml/Adaptive-Sparse-Trainer:adamw.py), with CAST's L1 in place of AST's L2 decay term:
        theta *= 1 - lr wd
        m = b1 m + (1-b1) g
        u = m + lambda_w * (1 - mask) * sign(theta)      (selective L1 decay on pruned coordinates)
        v = b2 v + (1-b2) u^2                             (the decay is preconditioned too: "adaptive")
        theta -= lr / (1 - b1^t) * u / (sqrt(v / (1 - b2^t)) + eps)
    A schedule of lambda_w is the caller's: pass a new AdamSHParams (dataclasses.replace).
    """
    assert index is None and master.shape == mask.shape, (index is None, master.shape, mask.shape)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    master.mul_(1 - lr * hp.weight_decay)
    state["step"] += 1
    step = int(state["step"])
    exp_avg.lerp_(grad, 1 - hp.beta1)
    update = exp_avg + hp.lambda_w * master.sign() * (~mask)
    exp_avg_sq.mul_(hp.beta2).addcmul_(update, update, value=1 - hp.beta2)
    bias1 = 1 - hp.beta1 ** step
    bias2_sqrt = (1 - hp.beta2 ** step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(hp.eps)
    master.addcdiv_(update, denom, value=-lr / bias1)
