"""`tans`: Topology-Aware Newton-Schulz on compressed values (paper s3.2, App. H.5; DESIGN s5).

On the active support (G, V, P, U are [out, k]; dense matrices: index None, [out, in]):
    V  = b2 V + (1-b2) G^2                 Gh = G / (sqrt(V) + eps)
    P  = b1 P + (1-b1) Gh                  U  = (1-b1) Gh + b1 P                 (masked base update)
    X0 = scatter(U) / (||U||_F + eps)      O  = NS_K(X0)  (lower-dimensional side)   O_M = gather(O)
    s  = RMS(U) / (RMS(O_M) + eps)         over the active entries (rms_mode post_mask_active)
    gamma = gamma_NS min(1, tau / B_ramp)  U' = U + gamma (s O_M - U)
    theta = (1 - lr wd) theta - lr sqrt(d_out / d_in) U'
geometry_only (paper s4.3, Table 3): the same V, P = b1 P + (1-b1) G and U = (1-b1) G + b1 P on the raw gradient,
    U' = s O_M with O_M from U as above and s = RMS(U / (sqrt(V) + eps)) / (RMS(O_M) + eps): the NS direction of the
    masked momentum at the step size of TANS's base update (rms_mode picks the RMS as for TANS; none: s = 1, the
    unscaled masked Muon step, 17-37x smaller than TANS's at the same lr on the small model).
tau counts optimizer steps since the matrix's last refresh (the first step after one has tau = 0: the pure base
update; NS is skipped whenever gamma = 0). `newton_schulz` normalizes X0 again, as every NS kernel does; X0
has unit norm, so that only applies the kernel's safety factor (X0 / 1.01 for Polar Express).
State: fp32 `V`, `P` shaped like the master; 0-dim int64 CPU counters `tau` (reset by refreshes, see
matrix_state.py) and `step` (bias correction only). In place on master and state.
Pure tensor functions: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

import torch

from distsparse.optim.hparams import TansHParams
from distsparse.optim.newton_schulz import newton_schulz
from distsparse.optim.support import rms, to_dense, to_values


def ramp_gamma(hp: TansHParams, tau: int) -> float:
    """gamma_t = gamma_NS min(1, tau / B_ramp); B_ramp = 0 means no ramp."""
    if hp.ramp_steps == 0:
        return hp.gamma_ns
    return hp.gamma_ns * min(1.0, tau / hp.ramp_steps)


def _geometry(update: torch.Tensor, hp: TansHParams, index: torch.Tensor | None, shape: tuple[int, int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_M fp32 [out, k], O [out, in] in NS's compute dtype): NS of the normalized scattered update and its
    projection to the mask; ||U||_F over the kept values (the zeros off the support add nothing)."""
    x0 = update / (torch.linalg.matrix_norm(update) + hp.eps)
    ortho = newton_schulz(x0, hp.ns_steps, hp.ns_coefficients, scatter=lambda values: to_dense(values, index, shape))
    return to_values(ortho, index, update.shape[1]).float(), ortho


def _rms_scale(update: torch.Tensor, ortho_m: torch.Tensor, ortho: torch.Tensor, hp: TansHParams,
               shape: tuple[int, int]) -> torch.Tensor | float:
    if hp.rms_mode == "post_mask_active":
        return rms(update) / (rms(ortho_m) + hp.eps)
    if hp.rms_mode == "pre_mask_global":
        # RMS over all out*in entries of scatter(U), whose off-support entries are zero.
        rms_all_update = torch.linalg.vector_norm(update) / (shape[0] * shape[1]) ** 0.5
        return rms_all_update / (rms(ortho) + hp.eps)
    return 1.0


def step_tans(master: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float,
              hp: TansHParams, index: torch.Tensor | None, shape: tuple[int, int]) -> None:
    V, P = state["V"], state["P"]
    tau = int(state["tau"])
    state["tau"] += 1
    state["step"] += 1
    step = int(state["step"])
    V.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
    second = V / (1 - hp.beta2 ** step) if hp.bias_correction else V
    if hp.geometry_only:
        P.lerp_(grad, 1 - hp.beta1)
        first = P / (1 - hp.beta1 ** step) if hp.bias_correction else P
        momentum = grad.lerp(first, hp.beta1)            # U = (1-b1) G + b1 P of the raw gradient
        ortho_m, ortho = _geometry(momentum, hp, index, shape)
        # TANS's step size: the same momentum preconditioned by V has the RMS of TANS's base update.
        direction = ortho_m * _rms_scale(momentum / (second.sqrt() + hp.eps), ortho_m, ortho, hp, shape)
    else:
        g_hat = grad / (second.sqrt() + hp.eps)
        P.lerp_(g_hat, 1 - hp.beta1)
        first = P / (1 - hp.beta1 ** step) if hp.bias_correction else P
        direction = g_hat.lerp(first, hp.beta1)          # U = (1-b1) Gh + b1 P
        gamma = ramp_gamma(hp, tau)
        if gamma > 0:
            ortho_m, ortho = _geometry(direction, hp, index, shape)
            scale = _rms_scale(direction, ortho_m, ortho, hp, shape)
            direction = direction.lerp(ortho_m * scale, gamma)   # U + gamma (s O_M - U)
    fan = (shape[0] / shape[1]) ** 0.5
    master.mul_(1 - lr * hp.weight_decay).add_(direction, alpha=-lr * fan)
