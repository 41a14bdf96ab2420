"""Group kernels: each update rule of rules_*.py applied at once to the k same-shape matrices of one group, stacked
[k, ...] (DESIGN decision 21; issue 25 item 1). The per-matrix rules stay the reference: tests/test_group_rules.py
checks every kernel against them to float32 round-off.

Shape legend: k matrices of one group; [k, r, c] their stacked values (r = out, c = kept per row; dense: c = in);
frame (out, in) the dense frame; index int64 [k, r * c] (row i: matrix i's flat kept index) or None (dense).

    kernel(master, grad, slots, *, lr, hp, index, frame, stats, **coefficients) -> dict[str, Tensor] | None
        master, grad, slots[key]: fp32 [k, r, c]; master and slots are updated in place (grad may be too).
        With `stats`, returns per-matrix statistics as [k, 1, 1] tensors (TANS: rms_scale, base_update_rms,
        corrected_update_rms; rms_scale is None when no Newton-Schulz ran, a float when it is constant).
    advance(counters, hp) -> coefficient lists
        Runs on the host before the kernel: steps the per-matrix counters (Python ints, one list of k per counter
        key) and returns what the kernel needs per matrix (bias corrections, TANS's gamma) as lists of k floats.
        The engine hands each list to the kernel as one float when all k agree (the steady state: no tensor,
        no copy) and as a [k, 1, 1] tensor otherwise (`per_matrix`), e.g. gamma while only some matrices ramp.
    host_stats(coefficients) -> per-matrix statistics known on the host (TANS: ramp_gamma).

Element-wise phases are a handful of broadcast kernels per group; Newton-Schulz runs once per group on the
[k, out, in] batch (newton_schulz.py); scatter/gather between the frames are one scatter_/gather each, the dense
frame built and read in NS's compute dtype (bf16 on a GPU) with the normalizations done on the values.
A zero weight decay skips the decay multiply (x * 1.0 is x: the reference's numbers are unchanged).
Pure tensor functions: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from distsparse.optim.hparams import AdamHParams, AdamSHParams, MuonHParams, TansHParams
from distsparse.optim.newton_schulz import newton_schulz
from distsparse.optim.rules_tans import ramp_gamma
from distsparse.optim.support import rms_stacked, to_dense_stacked, to_values_stacked

Coefficient = float | torch.Tensor   # one value for the whole group, or [k, 1, 1]


def per_matrix(values: list[float], device: torch.device) -> Coefficient:
    """One float when the k matrices agree, else a [k, 1, 1] fp32 tensor on `device` (a small host-to-device copy
    that does not wait for the device)."""
    first = values[0]
    if all(v == first for v in values):
        return float(first)
    host = torch.tensor(values, dtype=torch.float32, device="cpu").view(-1, 1, 1)
    return host.to(device, non_blocking=True)


def _applies(weight: Coefficient) -> bool:
    """A correction weight that is not 0 for every matrix (a tensor is one only when the matrices disagree)."""
    return isinstance(weight, torch.Tensor) or weight > 0


def _decay(master: torch.Tensor, lr: float, weight_decay: float) -> None:
    if weight_decay:
        master.mul_(1 - lr * weight_decay)


def _addcdiv_(target: torch.Tensor, num: torch.Tensor, den: torch.Tensor, value: Coefficient) -> None:
    """target += value * num / den, value a float or [k, 1, 1]."""
    if isinstance(value, torch.Tensor):
        target.addcdiv_(num * value, den)
    else:
        target.addcdiv_(num, den, value=value)


# ---- TANS (rules_tans.py) ----------------------------------------------------------------------------------------

def _scatter(index: torch.Tensor | None, frame: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda values: to_dense_stacked(values, index, frame)


def _geometry(update: torch.Tensor, hp: TansHParams, index: torch.Tensor | None, frame: tuple[int, int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_M fp32 [k, r, c], O [k, out, in] in Newton-Schulz's compute dtype): NS of each normalized scattered
    update, and its projection to each mask. X0 = scatter(U) / (||U|| + eps) is normalized on the values and the
    scatter writes NS's compute dtype (newton_schulz's `scatter`): no fp32 pass over a dense frame (issue 25). X0's
    division and NS's own stay two, as in rules_tans.py: fused into one they differ by fp32 rounding, which the
    quintic iterations amplify to ~4e-6 of the update."""
    x0 = update / (torch.linalg.matrix_norm(update, keepdim=True) + hp.eps)
    ortho = newton_schulz(x0, hp.ns_steps, hp.ns_coefficients, scatter=_scatter(index, frame))
    return to_values_stacked(ortho, index, update.shape).float(), ortho


def _rms_scale(update: torch.Tensor, ortho_m: torch.Tensor, ortho: torch.Tensor, hp: TansHParams,
               frame: tuple[int, int]) -> torch.Tensor | float:
    if hp.rms_mode == "post_mask_active":
        return rms_stacked(update) / (rms_stacked(ortho_m) + hp.eps)
    if hp.rms_mode == "pre_mask_global":
        # RMS over all out*in entries of scatter(U), whose off-support entries are zero.
        rms_all_update = torch.linalg.vector_norm(update, dim=(-2, -1), keepdim=True) / (frame[0] * frame[1]) ** 0.5
        return rms_all_update / (rms_stacked(ortho) + hp.eps)
    return 1.0


def _split_graph() -> None:
    """Under torch.compile, end the graph here: TANS's in-place moment updates and its Newton-Schulz correction in one
    inductor graph fail to compile in torch 2.13 (InductorError KeyError 'bufN' from the loop-body scheduler); as two
    graphs they compile and give the eager numbers. Eagerly a no-op (no aten op)."""
    torch._dynamo.graph_break()


def tans_advance(counters: dict[str, list[int]], hp: TansHParams) -> dict[str, list[float]]:
    """gamma from tau before the step (tau = 0 right after a refresh: the pure base update), then tau and step + 1."""
    tau = counters["tau"]
    step = [s + 1 for s in counters["step"]]
    counters["tau"], counters["step"] = [t + 1 for t in tau], step
    coefficients = {"gamma": [ramp_gamma(hp, t) for t in tau]}
    if hp.bias_correction:
        coefficients["second_div"] = [1 - hp.beta2 ** s for s in step]
        coefficients["first_div"] = [1 - hp.beta1 ** s for s in step]
    return coefficients


def tans_kernel(master: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], *, lr: float,
                hp: TansHParams, index: torch.Tensor | None, frame: tuple[int, int], stats: bool = False,
                gamma: Coefficient, second_div: Coefficient = 1.0, first_div: Coefficient = 1.0
                ) -> dict[str, torch.Tensor | float | None] | None:
    V, P = slots["V"], slots["P"]
    V.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
    second = V / second_div if hp.bias_correction else V
    scale = None
    if hp.geometry_only:
        P.lerp_(grad, 1 - hp.beta1)
        first = P / first_div if hp.bias_correction else P
        momentum = grad.lerp(first, hp.beta1)            # U = (1-b1) G + b1 P of the raw gradient
        _split_graph()
        ortho_m, ortho = _geometry(momentum, hp, index, frame)
        base = momentum / (second.sqrt() + hp.eps)       # its TANS-preconditioned form sets the step size
        scale = _rms_scale(base, ortho_m, ortho, hp, frame)
        direction = ortho_m * scale
    else:
        g_hat = grad / (second.sqrt() + hp.eps)
        P.lerp_(g_hat, 1 - hp.beta1)
        first = P / first_div if hp.bias_correction else P
        base = g_hat.lerp(first, hp.beta1)              # U = (1-b1) Gh + b1 P
        direction = base
        if _applies(gamma):
            _split_graph()
            ortho_m, ortho = _geometry(base, hp, index, frame)
            scale = _rms_scale(base, ortho_m, ortho, hp, frame)
            direction = base.lerp(ortho_m * scale, gamma)   # U + gamma (s O_M - U)
    _decay(master, lr, hp.weight_decay)
    master.add_(direction, alpha=-lr * (frame[0] / frame[1]) ** 0.5)
    if not stats:
        return None
    return {"rms_scale": scale, "base_update_rms": rms_stacked(base), "corrected_update_rms": rms_stacked(direction)}


def tans_host_stats(coefficients: dict[str, list[float]]) -> dict[str, list[float]]:
    return {"ramp_gamma": coefficients["gamma"]}


# ---- Muon (rules_muon.py) ----------------------------------------------------------------------------------------

def no_counters(counters: dict[str, list[int]], hp) -> dict[str, list[float]]:
    return {}


def muon_kernel(master: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], *, lr: float,
                hp: MuonHParams, index: torch.Tensor | None, frame: tuple[int, int], stats: bool = False) -> None:
    momentum = slots["momentum"]
    momentum.lerp_(grad, 1 - hp.momentum)
    update = grad.lerp(momentum, hp.momentum) if hp.nesterov else momentum
    ortho = newton_schulz(update, hp.ns_steps, hp.ns_coefficients, scatter=_scatter(index, frame))
    _decay(master, lr, hp.weight_decay)
    # add_ upcasts NS's compute dtype inside its kernel
    master.add_(to_values_stacked(ortho, index, master.shape), alpha=-lr * max(1.0, frame[0] / frame[1]) ** 0.5)


# ---- Adam, AdamW, AdamS (rules_adam.py) --------------------------------------------------------------------------

def adam_advance(counters: dict[str, list[int]], hp: AdamHParams) -> dict[str, list[float]]:
    step = [s + 1 for s in counters["step"]]
    counters["step"] = step
    return {"bias1": [1 - hp.beta1 ** s for s in step], "bias2_sqrt": [(1 - hp.beta2 ** s) ** 0.5 for s in step]}


def _second_moment_step(master: torch.Tensor, update: torch.Tensor, exp_avg_sq: torch.Tensor, lr: float,
                        hp: AdamHParams, bias1: Coefficient, bias2_sqrt: Coefficient, numerator: torch.Tensor) -> None:
    exp_avg_sq.mul_(hp.beta2).addcmul_(update, update, value=1 - hp.beta2)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(hp.eps)
    _addcdiv_(master, numerator, denom, -lr / bias1)


def adam_kernel(master: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], *, lr: float,
                hp: AdamHParams, index, frame, stats: bool = False, bias1: Coefficient,
                bias2_sqrt: Coefficient) -> None:
    """torch.optim.Adam: weight_decay is L2 (added to the gradient before the moments)."""
    if hp.weight_decay:
        grad = grad.add(master, alpha=hp.weight_decay)
    slots["exp_avg"].lerp_(grad, 1 - hp.beta1)
    _second_moment_step(master, grad, slots["exp_avg_sq"], lr, hp, bias1, bias2_sqrt, slots["exp_avg"])


def adamw_kernel(master: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], *, lr: float,
                 hp: AdamHParams, index, frame, stats: bool = False, bias1: Coefficient,
                 bias2_sqrt: Coefficient) -> None:
    """torch.optim.AdamW: decoupled decay theta *= 1 - lr wd, then Adam."""
    _decay(master, lr, hp.weight_decay)
    slots["exp_avg"].lerp_(grad, 1 - hp.beta1)
    _second_moment_step(master, grad, slots["exp_avg_sq"], lr, hp, bias1, bias2_sqrt, slots["exp_avg"])


def adams_kernel(master: torch.Tensor, grad: torch.Tensor, slots: dict[str, torch.Tensor], *, lr: float,
                 hp: AdamSHParams, index, frame, stats: bool = False, bias1: Coefficient, bias2_sqrt: Coefficient,
                 pruned: torch.Tensor) -> None:
    """CAST's AdamS (rules_adam.step_adams) on dense latents [k, out, in]; `pruned` bool [k, out, in] is the
    complement of each matrix's current support."""
    _decay(master, lr, hp.weight_decay)
    slots["exp_avg"].lerp_(grad, 1 - hp.beta1)
    update = slots["exp_avg"] + hp.lambda_w * master.sign() * pruned
    _second_moment_step(master, update, slots["exp_avg_sq"], lr, hp, bias1, bias2_sqrt, update)


def no_host_stats(coefficients: dict[str, list[float]]) -> dict[str, list[float]]:
    return {}


class GroupRule(NamedTuple):
    kernel: Callable[..., dict | None]
    advance: Callable[[dict[str, list[int]], object], dict[str, list[float]]]
    host_stats: Callable[[dict[str, list[float]]], dict[str, list[float]]] = no_host_stats
    stat_keys: tuple[str, ...] = ()   # what `stats=True` reports per matrix (kernel's and host_stats' keys)


GROUP_RULES: dict[str, GroupRule] = {
    "adam": GroupRule(adam_kernel, adam_advance),
    "adamw": GroupRule(adamw_kernel, adam_advance),
    "adams": GroupRule(adams_kernel, adam_advance),
    "muon": GroupRule(muon_kernel, no_counters),
    "tans": GroupRule(tans_kernel, tans_advance, tans_host_stats,
                      ("rms_scale", "ramp_gamma", "base_update_rms", "corrected_update_rms")),
}
