"""`DenseLatentLinear`: the dense-to-sparse baselines, a linear layer whose backbone is a dense latent `weight` [O, I].

The weight is owned by the matrix engine with a mask-of-ones layout (DESIGN decision 10); this module only says
how the forward, the gradient and the export use it. Shape legend: T tokens, I in_features, O out_features,
G scale groups per row. m(W) = mask_from_scores(|W|, N, layout): top-N per row group of 4, or the best motif per
4x4 block (CHTsNM paper App. H.1-H.3; research/permutations_pruning.md s7, s8.D).

    dense   y = x W^T
    ste     y = x (W * m(W))^T, m recomputed every forward; dL/dW = dL/d(W * m)   (straight-through, App. H.1)
    srste   ste, and dL/dW += lambda_w * W * (1 - m), lambda_w = 1e-4               (App. H.2)
    cast    training: y = x (W * s)^T, dense; s [O, G] fp32, learned, starting at 1   (App. H.3)
            m is recomputed every `mask_update_interval` (10) steps by `maybe_update_mask(step)`; the optimizer rule
            `adams` decays the coordinates outside `current_mask()` (that decay lives in distsparse/optim, not here).
            export and eval-mode forward: the legal projection (W * s) * m(W * s), never the dense weight.

CAST scale groups (RECONSTRUCTION: the seed says "scaling groups = 2" and nothing more; CAST's code is not public,
research/permutations_pruning.md s10): each output row's I inputs are cut into G equal contiguous chunks with one
learned scale each, every chunk a whole number of 4-column N:M groups. A scale is then constant inside every N:M
group, so scaling never changes which entries a group keeps ("Weight Scaling ... while preserving desired sparsity
patterns", CAST abstract): m(W * s) = m(W) while no scale is zero. Block-wise CAST is refused (App. H.3).

SR-STE's term is added once per backward call: with k accumulated micro-batches whose losses are each divided by k,
`set_micro_batches(k)` adds lambda_w / k per backward, so a step keeps the paper's per-step decay.

`LatentParams` are the method options of these baselines (`method.latent_args`), checked when the config is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsparse.nm import NMMeta, NMSpec, codes_shape, decode, encode, mask_from_scores

MODES = ("dense", "ste", "srste", "cast")
INIT_MODES = ("hf", "swi")
CAST_BLOCK_REASON = (
    "CAST keeps a dense forward weight during training and becomes sparse only at export, so it cannot use the "
    "training acceleration that block-wise (transposable) masks exist for; the paper evaluates CAST row-wise only "
    "(CHTsNM paper App. H.3)")


@dataclass(frozen=True, kw_only=True)
class LatentParams:
    """Options of the dense-latent baselines; each applies to the modes in `MODES_OF`."""
    lambda_w: float = 1e-4              # srste: decay of the pruned entries (App. H.2)
    mask_update_interval: int = 10      # cast: steps between mask recomputations (App. H.3)
    num_scale_groups: int = 2           # cast: learned scales per output row (App. H.3, RECONSTRUCTION above)

    MODES_OF = {"lambda_w": ("srste",), "mask_update_interval": ("cast",), "num_scale_groups": ("cast",)}

    def __post_init__(self) -> None:
        if not self.lambda_w >= 0:
            raise ValueError(f"lambda_w: got {self.lambda_w!r}; allowed: a number >= 0")
        if self.mask_update_interval < 1:
            raise ValueError(f"mask_update_interval: got {self.mask_update_interval!r}; allowed: an integer >= 1")
        if self.num_scale_groups < 1:
            raise ValueError(f"num_scale_groups: got {self.num_scale_groups!r}; allowed: an integer >= 1")


class MaskedSTE(torch.autograd.Function):
    """W * mask forward; backward passes dL/d(W * mask) straight to W, plus lambda_w * W on pruned entries."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, mask: torch.Tensor, lambda_w: float) -> torch.Tensor:
        ctx.lambda_w = lambda_w
        if lambda_w:
            ctx.save_for_backward(weight, mask)
        return weight * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.lambda_w:
            return grad, None, None
        weight, mask = ctx.saved_tensors
        return grad + (ctx.lambda_w * weight) * ~mask, None, None


class DenseLatentLinear(nn.Module):
    """Drop-in for `nn.Linear` whose `weight` [O, I] is a dense latent matrix used per `mode` (module docstring)."""

    def __init__(self, in_features: int, out_features: int, spec: NMSpec | None, mode: str, *,
                 bias: bool = False, lambda_w: float = 1e-4, mask_update_interval: int = 10,
                 num_scale_groups: int = 2, init: str = "hf", init_std: float = 0.02, seed: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
        if init not in INIT_MODES:
            raise ValueError(f"init: got {init!r}; allowed: {', '.join(INIT_MODES)}")
        if mode == "dense" and spec is not None:
            raise ValueError(f"sparsity: got {spec} for mode 'dense'; allowed: none")
        if mode != "dense":
            if spec is None:
                raise ValueError(f"sparsity: got none for mode {mode!r}; allowed: an N:4 spec")
            spec.check_shape(out_features, in_features)
        LatentParams(lambda_w=lambda_w, mask_update_interval=mask_update_interval, num_scale_groups=num_scale_groups)
        if mode == "cast":
            if spec.layout == "block":
                raise ValueError(f"sparsity layout: got 'block' for mode 'cast'; allowed: row. {CAST_BLOCK_REASON}")
            if in_features % (4 * num_scale_groups):
                raise ValueError(
                    f"num_scale_groups: got {num_scale_groups!r} for in_features={in_features}; allowed: a count "
                    f"G >= 1 with in_features divisible by 4 * G (each scale chunk holds whole groups of 4)")
        self.in_features, self.out_features, self.spec, self.mode = in_features, out_features, spec, mode
        self.lambda_w = lambda_w if mode == "srste" else 0.0
        self.micro_batches = 1
        self.mask_update_interval = mask_update_interval
        self.init, self.init_std, self.seed = init, init_std, seed
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        if mode == "cast":
            # fp32 scales and an fp32 multiply, cast back for the forward (App. H.3).
            self.scale = nn.Parameter(torch.ones(out_features, num_scale_groups, device=device, dtype=torch.float32))
            # The mask between updates is training state (the adams decay reads it): persistent, packed.
            self.register_buffer("codes", torch.zeros(codes_shape(spec, out_features, in_features),
                                                      dtype=torch.uint8, device=device))
        if self.weight.device.type != "meta":
            self.reset_parameters()

    def init_std_value(self) -> float:
        """hf: the model's initializer_range; swi: N(0, 2 / (density * fan_in)) with the forward's density."""
        if self.init == "hf":
            return self.init_std
        density = self.spec.density if self.mode in ("ste", "srste") else 1.0
        return math.sqrt(2.0 / (density * self.in_features))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weights from a generator seeded by `seed`: the engine owns them, so every rank must draw the same."""
        gen = torch.Generator().manual_seed(self.seed)
        self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * self.init_std_value())
        if self.bias is not None:
            self.bias.zero_()
        if self.mode == "cast":
            self.scale.fill_(1.0)
            self.refresh_mask()

    def scaled_weight(self) -> torch.Tensor:
        """CAST: W * s [O, I], multiplied in (at least) fp32 and cast back to W's dtype."""
        out_f, in_f = self.weight.shape
        groups = self.scale.shape[1]
        wide = self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))
        scaled = wide.view(out_f, groups, in_f // groups) * self.scale.unsqueeze(-1)
        return scaled.view(out_f, in_f).to(self.weight.dtype)

    def _projection_mask(self, weight: torch.Tensor) -> torch.Tensor:
        return mask_from_scores(weight.detach().abs(), self.spec.n, self.spec.layout)

    @torch.no_grad()
    def refresh_mask(self) -> None:
        """CAST: recompute the stored mask from the scaled weight."""
        self.codes.copy_(encode(self._projection_mask(self.scaled_weight()), self.spec).codes)

    def set_micro_batches(self, count: int) -> None:
        """SR-STE: backward calls per optimizer step; each adds lambda_w / count * W on the pruned entries."""
        if count < 1:
            raise ValueError(f"micro_batches: got {count!r}; allowed: an integer >= 1")
        self.micro_batches = count

    def maybe_update_mask(self, step: int) -> bool:
        """CAST: refresh the mask when `step` is a multiple of `mask_update_interval`; True when it did.
        Other modes have no stored mask (ste/srste recompute it every forward) and return False."""
        if self.mode != "cast" or step % self.mask_update_interval:
            return False
        self.refresh_mask()
        return True

    def current_mask(self) -> torch.Tensor:
        """Bool [O, I]: all ones (dense), m(W) (ste/srste), or the stored mask (cast)."""
        if self.mode == "dense":
            return torch.ones_like(self.weight, dtype=torch.bool)
        if self.mode == "cast":
            return decode(NMMeta(self.codes, self.spec, (self.out_features, self.in_features)))
        return self._projection_mask(self.weight)

    def export_mask(self) -> torch.Tensor:
        """Bool [O, I]: the legal mask of `export_weight` (all ones for dense)."""
        if self.mode == "cast":
            return self._projection_mask(self.scaled_weight())
        return self.current_mask()

    @torch.no_grad()
    def export_weight(self) -> torch.Tensor:
        """The legal sparse [O, I] weight used for evaluation and export: W * m(W), or for CAST the projection of the
        scaled weight (W * s) * m(W * s), never the dense one. Dense mode returns W."""
        if self.mode == "dense":
            return self.weight.detach().clone()
        weight = self.scaled_weight() if self.mode == "cast" else self.weight.detach()
        return weight * self._projection_mask(weight)

    @torch.no_grad()
    def projection_cut(self) -> tuple[float, float]:
        """CAST: (squared norm of the scaled weight outside its projection mask, squared norm of all of it) in
        fp64, the part of the trained weight the final projection throws away."""
        weight = self.scaled_weight().double()
        return float(weight[~self._projection_mask(weight)].square().sum()), float(weight.square().sum())

    def effective_weight(self) -> torch.Tensor:
        """The [O, I] weight the forward uses, with autograd (CAST in eval mode uses the export projection)."""
        if self.mode == "dense":
            return self.weight
        if self.mode == "cast":
            return self.scaled_weight() if self.training else self.export_weight()
        return MaskedSTE.apply(self.weight, self._projection_mask(self.weight), self.lambda_w / self.micro_batches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        sparsity = "none" if self.spec is None else str(self.spec)
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"sparsity={sparsity}")


def cast_metrics(modules) -> dict[str, float]:
    """`cast/projection_cut`: the share of the CAST layers' squared weight norm the final projection removes (it
    must fall toward 0 for the projected model to keep the dense-forward model's quality); {} without CAST."""
    cuts = [m.projection_cut() for m in modules if isinstance(m, DenseLatentLinear) and m.mode == "cast"]
    if not cuts:
        return {}
    return {"cast/projection_cut": sum(c for c, _ in cuts) / max(sum(t for _, t in cuts), 1e-300)}
