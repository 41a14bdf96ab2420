"""The training model as plain `LlamaForCausalLM` weights: what tools/export_hf.py and tools/consolidate.py write.

A projection of the training model is a backbone core (N:M values and codes, or a dense latent), optionally behind
an input permutation and beside a residual branch (distsparse/layers/projection.py). It reduces to one HF weight
when every part is linear in x and fixed: the core's decompressed weight, a hard input gather folded into its
columns (W (x[..., perm]) = W[:, inv] x), and a LoRA branch folded in (W + (alpha/r) B A). Input-dependent branches
(CoMoLoRA `como`, `prod_gate`) and soft permutation blocks (a doubly stochastic mix before T_perm) do not reduce;
`unfoldable` names the first such part.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsparse.checkpoint.model import TrainedModel
from distsparse.layers import NMSparseLinear
from distsparse.layers.branches import FOLDABLE_KINDS, foldable
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.projection import SparseProjection
from distsparse.models import projection_names


def decompressed_weight(core: nn.Module) -> torch.Tensor:
    """fp32 [O, I]: the backbone weight a core computes with at evaluation."""
    if isinstance(core, NMSparseLinear):
        return core.dense_weight()
    if isinstance(core, DenseLatentLinear):
        return core.export_weight()
    return core.weight.detach()


def input_permutations(model: nn.Module) -> dict[str, BlockPermutation]:
    """Projection name -> the input permutation it still applies (shared ones appear under each reader)."""
    out = {}
    for name in projection_names(model):
        outer = model.get_submodule(name)
        if isinstance(outer, SparseProjection) and outer.permutation is not None:
            out[name] = outer.permutation
    return out


def unfoldable(trained: TrainedModel) -> str | None:
    """Why the model's projections do not all reduce to one weight each (naming the part), or None."""
    kind = trained.cfg.method.branch.kind
    if not foldable(kind):
        return (f"method.branch.kind: got {kind!r}; a {kind} branch is input-dependent (its output is modulated by "
                f"a function of x), so it does not fold into a LlamaForCausalLM weight. Allowed for export: "
                f"{', '.join(FOLDABLE_KINDS)}. Evaluate this model in memory (distsparse.eval) instead")
    for name, perm in input_permutations(trained.model).items():
        if not perm.all_hard():
            return (f"{name}: {int((~perm.hard_mask).sum())} of {perm.num_blocks} input permutation blocks are still "
                    f"soft (a doubly stochastic mix, not a gather): folded into the weight it would give W M, a "
                    f"dense matrix, not an N:M sparse one. Export a checkpoint saved at or after T_perm "
                    f"(method.permutation.t_perm_fraction), when every block is hard")
    return None


@torch.no_grad()
def projection_weight(outer: nn.Module, fold: bool = True) -> torch.Tensor:
    """[O, I] fp32. `fold`: x W^T equals the projection's output (backbone with its hard input gather in its
    columns, plus a LoRA branch, which reads the unpermuted x); otherwise the backbone core's weight alone."""
    if not isinstance(outer, SparseProjection):
        return decompressed_weight(outer).float()
    weight = decompressed_weight(outer.core).float()
    if not fold:
        return weight
    if outer.permutation is not None:
        weight = weight[:, outer.permutation.inverse_indices()]    # W (x[perm]) = W[:, inv] x
    if outer.branch is not None:
        weight = weight + outer.branch.delta_weight().float()
    return weight


def hf_state_dict(model: nn.Module, fold: bool = True) -> dict[str, torch.Tensor]:
    """Exactly the keys of a LlamaForCausalLM: the training model's own parameters outside the projections (HF
    names already) and one `<projection>.weight` per projection (projection_weight)."""
    names = projection_names(model)
    inside = {id(p) for name in names for p in model.get_submodule(name).parameters()}
    state = {n: p.detach().float().contiguous() for n, p in model.named_parameters() if id(p) not in inside}
    for name in names:
        state[f"{name}.weight"] = projection_weight(model.get_submodule(name), fold).contiguous()
    return state
