"""Hyperparameters of the per-matrix update rules: one frozen dataclass per rule, real defaults, checked on build.

`lr` is the peak learning rate a run's schedule starts from; the step functions never read it: they take
the scheduled value as their `lr=` argument. A bad value raises ValueError naming the field, the value and
what is allowed (DESIGN s6).
"""

from __future__ import annotations

from dataclasses import dataclass

from distsparse.optim.newton_schulz import COEFFICIENT_SETS

RMS_MODES = ("none", "pre_mask_global", "post_mask_active")


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: got {value!r}; allowed: 0 <= {name} < 1")


def _check_nonneg(name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{name}: got {value!r}; allowed: >= 0")


def _check_positive(name: str, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"{name}: got {value!r}; allowed: > 0")


def _check_ns(coefficients: str, steps: int) -> None:
    if coefficients not in COEFFICIENT_SETS:
        raise ValueError(f"ns_coefficients: got {coefficients!r}; allowed: {', '.join(COEFFICIENT_SETS)}")
    spec = COEFFICIENT_SETS[coefficients]
    limit = None if spec.repeat_last else len(spec.per_step)
    if not isinstance(steps, int) or steps < 1 or (limit is not None and steps > limit):
        allowed = "an integer >= 1" if limit is None else f"an integer in 1..{limit}"
        raise ValueError(f"ns_steps: got {steps!r} for ns_coefficients {coefficients!r}; allowed: {allowed}")


@dataclass(frozen=True, kw_only=True)
class AdamHParams:
    """Adam (`adam`: weight_decay is L2 added to the gradient, torch.optim.Adam) or AdamW (`adamw`: decoupled,
    theta *= 1 - lr wd, torch.optim.AdamW). Bias-corrected, as torch does."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_unit("beta1", self.beta1)
        _check_unit("beta2", self.beta2)
        _check_nonneg("eps", self.eps)
        _check_nonneg("weight_decay", self.weight_decay)


@dataclass(frozen=True, kw_only=True)
class AdamSHParams(AdamHParams):
    """CAST's AdamS (paper App. H.3): AdamW plus an L1 decay `lambda_w` on the currently pruned coordinates of a
    dense latent weight, fed through the moments (research/permutations_pruning.md s7)."""
    lambda_w: float = 2e-4

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_nonneg("lambda_w", self.lambda_w)


@dataclass(frozen=True, kw_only=True)
class MuonHParams:
    """Masked Muon (KellerJordan/Muon `muon_update`): momentum, Nesterov, NS of the scattered update, projection
    to the mask, scale max(1, out/in)^0.5, decoupled weight decay."""
    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    ns_steps: int = 5
    ns_coefficients: str = "polar_express"

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_unit("momentum", self.momentum)
        _check_nonneg("weight_decay", self.weight_decay)
        _check_ns(self.ns_coefficients, self.ns_steps)


@dataclass(frozen=True, kw_only=True)
class TansHParams:
    """TANS (paper s3.2; DESIGN s5). Defaults are App. H.5's canonical settings.

    Ablation switches (DESIGN s5, paper App. I):
      gamma_ns      strength of the NS correction; 0 = the masked preconditioned base update only.
      ramp_steps    B_ramp: gamma = gamma_ns * min(1, tau / B_ramp); 0 = no ramp (gamma_ns from tau = 0).
      rms_mode      none (s = 1) | pre_mask_global (s = RMS_all(scatter U) / RMS_all(O), over out*in entries)
                    | post_mask_active (s = RMS(U) / RMS(O_M), over the active entries; the paper's rule).
      geometry_only masked Muon inside TANS (paper s4.3 "geometry-only"): U' = s O_M, the NS of the masked
                    Nesterov momentum of the raw gradient (P = b1 P + (1-b1) G, U = (1-b1) G + b1 P), scaled by
                    rms_mode to the RMS of U / (sqrt(V) + eps), i.e. to TANS's base-update step size, so that
                    the ablation differs from TANS in direction, not in step size; gamma_ns and ramp_steps have
                    no effect. With rms_mode none (s = 1) and beta1 = the momentum it is rule `muon` with TANS's
                    fan-ratio scale sqrt(out/in) in place of KellerJordan's max(1, out/in)^0.5.
      bias_correction  Adam-style correction (the paper has none): V / (1 - b2^t) and P / (1 - b1^t), t the
                    matrix's step count (not reset by refreshes).
    """
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-5
    weight_decay: float = 0.0
    gamma_ns: float = 0.5
    ramp_steps: int = 8
    rms_mode: str = "post_mask_active"
    geometry_only: bool = False
    bias_correction: bool = False
    ns_steps: int = 5
    ns_coefficients: str = "polar_express"

    def __post_init__(self) -> None:
        _check_positive("lr", self.lr)
        _check_unit("beta1", self.beta1)
        _check_unit("beta2", self.beta2)
        _check_positive("eps", self.eps)
        _check_nonneg("weight_decay", self.weight_decay)
        _check_nonneg("gamma_ns", self.gamma_ns)
        if not isinstance(self.ramp_steps, int) or self.ramp_steps < 0:
            raise ValueError(f"ramp_steps: got {self.ramp_steps!r}; allowed: an integer >= 0")
        if self.rms_mode not in RMS_MODES:
            raise ValueError(f"rms_mode: got {self.rms_mode!r}; allowed: {', '.join(RMS_MODES)}")
        _check_ns(self.ns_coefficients, self.ns_steps)
