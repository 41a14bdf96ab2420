"""Method hooks: where a method adds work to the generic step (DESIGN decision 18). The trainer, the joint step and
the matrix engine hold no method names; each method that needs more than its backbone rule plugs in here.

    before_step(step)   before the first forward of step `step` (0-based)       CAST: mask update
    extra_loss(step)    a term added to every micro-batch's loss, or None       Add+Align, ShuffleSparse penalty
    after_step(taken)   after both sides stepped (taken = step + 1); metrics    ShuffleSparse hardening
    metrics()           evaluation-time metrics                                  CAST: projection cut
    saved_state()       components the checkpoint's registry file keeps           ShuffleSparse: learned blocks

SR-STE's decay is added once per backward inside the layer, unscaled by the 1/grad_accum DeepSpeed applies to the
loss, so its hook tells the layers how many micro-batches a step has (the per-step decay stays the paper's
lambda_w). `build_method_hooks` reads the built model, not the method's name, to decide which hooks a run gets.
`saved_state` names what export and consolidation read back from project files alone (checkpoint/model.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsparse.config import MethodConfig, PermutationConfig
from distsparse.layers.branches import AddAlignBranch, mean_aux_loss
from distsparse.layers.dense_latent import DenseLatentLinear, cast_metrics
from distsparse.train.permutation_policy import PermutationPolicy


class MethodHooks:
    """No-op base: a method overrides what it needs."""

    def before_step(self, step: int) -> None:
        pass

    def extra_loss(self, step: int) -> torch.Tensor | None:
        return None

    def after_step(self, taken: int) -> dict[str, float]:
        return {}

    def metrics(self) -> dict[str, float]:
        return {}

    def saved_state(self) -> dict[str, nn.Module]:
        return {}


class SRSTEHooks(MethodHooks):
    """SR-STE (App. H.2): lambda_w * W on pruned entries once per step, whatever the accumulation."""

    def __init__(self, layers: list[DenseLatentLinear], micro_batches: int):
        for layer in layers:
            layer.set_micro_batches(micro_batches)


class CASTHooks(MethodHooks):
    """CAST (App. H.3): the stored mask is recomputed every mask_update_interval steps; the projection cut (how much
    of the trained weight the final legal projection throws away) is an evaluation metric."""

    def __init__(self, layers: list[DenseLatentLinear]):
        self.layers = layers

    def before_step(self, step: int) -> None:
        for layer in self.layers:
            layer.maybe_update_mask(step)

    def metrics(self) -> dict[str, float]:
        return cast_metrics(self.layers)


class AuxLossHooks(MethodHooks):
    """Branches with an auxiliary loss (Add+Align's alignment term): their mean joins every micro-batch's loss."""

    def __init__(self, model: nn.Module):
        self.model = model

    def extra_loss(self, step: int) -> torch.Tensor | None:
        return mean_aux_loss(self.model)


class PermutationHooks(MethodHooks):
    """ShuffleSparse: the penalty on the soft blocks joins the loss; blocks harden after the step."""

    def __init__(self, policy: PermutationPolicy):
        self.policy = policy

    def extra_loss(self, step: int) -> torch.Tensor | None:
        return self.policy.penalty(step)

    def after_step(self, taken: int) -> dict[str, float]:
        return self.policy.after_step(taken)

    def saved_state(self) -> dict[str, nn.Module]:
        # theta and hardening also live in DeepSpeed's module file; this copy is keyed by module name
        return dict(self.policy.perms)


class HookSet(MethodHooks):
    """Several methods' hooks as one: called in order, extra losses summed, metrics merged."""

    def __init__(self, hooks: list[MethodHooks]):
        self.hooks = hooks

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def extra_loss(self, step: int) -> torch.Tensor | None:
        terms = [t for hook in self.hooks if (t := hook.extra_loss(step)) is not None]
        return torch.stack(terms).sum() if len(terms) > 1 else (terms[0] if terms else None)

    def after_step(self, taken: int) -> dict[str, float]:
        return {k: v for hook in self.hooks for k, v in hook.after_step(taken).items()}

    def metrics(self) -> dict[str, float]:
        return {k: v for hook in self.hooks for k, v in hook.metrics().items()}

    def saved_state(self) -> dict[str, nn.Module]:
        return {k: v for hook in self.hooks for k, v in hook.saved_state().items()}


def build_method_hooks(model: nn.Module, backbone: dict[str, nn.Module], method: MethodConfig | None = None, *,
                       micro_batches: int, total_steps: int = 1) -> HookSet:
    """The hooks the built model calls for: SR-STE and CAST latents, branches with an aux loss, learned
    permutations (their penalty and hardening schedule: `method.permutation` over `total_steps`)."""
    latents = [m for m in backbone.values() if isinstance(m, DenseLatentLinear)]
    hooks: list[MethodHooks] = []
    srste = [m for m in latents if m.mode == "srste"]
    if srste:
        hooks.append(SRSTEHooks(srste, micro_batches))
    cast = [m for m in latents if m.mode == "cast"]
    if cast:
        hooks.append(CASTHooks(cast))
    if any(isinstance(m, AddAlignBranch) for m in model.modules()):
        hooks.append(AuxLossHooks(model))
    permutations = PermutationPolicy(method.permutation if method else PermutationConfig(), model, total_steps)
    if permutations.active:
        hooks.append(PermutationHooks(permutations))
    return HookSet(hooks)
