"""Fold hardened input permutations into the output rows of the layer that writes the input (issue 8 item 3).

A hard permutation is y = x[..., perm] (permutation.py). When x is the output of linear maps that feed nothing
else, permuting their output rows makes them emit x[..., perm] directly, and the gather goes away: NVIDIA ASP's
"fold into the previous layer", where the ShuffleSparse paper (seed s3.4) keeps a runtime re-index. In LLaMA:

    down_proj input  h = act(gate(x)) * up(x)     elementwise, so permuting the output rows of gate AND up by perm
                                                  gives h[..., perm]
    o_proj input     a = attention(q, k, v)       attention mixes tokens, never features, within a head: permuting
                                                  v's output features gives a[..., perm] if perm maps every head's
                                                  features onto the same head (true when the permutation blocks lie
                                                  within heads, i.e. block_size divides head_dim); with grouped
                                                  key/value heads, the heads sharing one v head need the same perm

Row permutation of a weight: y'_i = y_{perm[i]} needs W' = W[perm, :] (and bias[perm]). For a row-wise N:M matrix
each row is its own groups, so NMSparseLinear's values [O, K] and codes [O, *] rows move as they are and stay
legal. A block-wise (transposable 4x4) matrix is legal only if rows move between aligned groups of 4 as whole
groups, which a learned block permutation does not respect: the gather stays. q/k/v and gate/up read the RMSNorm
output of the residual stream, written by no linear layer of its own: the gather stays.

Branches: the output side of the writer's branch moves with its rows (LoRA/CoMoLoRA B rows, Prod-Gate's last
layer), and the reader's branch, which reads the unpermuted input, now sees x[..., perm], so its input side takes
the columns A[:, perm] (and the CoMoLoRA/Prod-Gate controller's first layer). CoMoLoRA's modulation acts in rank
space, so every branch kind folds exactly.

Folding rewrites weights in place for inference and export; the matrix engine's masters and optimizer state are
not moved, so do not train a folded model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distsparse.layers.branches import CoMoLoRABranch, LoRABranch, NoBranch, ProdGateBranch
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.layers.nm_linear import NMSparseLinear
from distsparse.layers.projection import SparseProjection, backbone_core

KEPT_SHARED_INPUT = ("reads the RMSNorm output of the residual stream (shared by {group}), which no linear layer "
                     "writes: folding would permute the whole residual stream; the gather stays")


@torch.no_grad()
def _take_rows(tensor: torch.Tensor, perm: torch.Tensor) -> None:
    tensor.copy_(tensor.index_select(0, perm.to(tensor.device)))


@torch.no_grad()
def _take_columns(tensor: torch.Tensor, perm: torch.Tensor) -> None:
    tensor.copy_(tensor.index_select(1, perm.to(tensor.device)))


def _row_fold_refusal(core: nn.Module) -> str | None:
    """Why the output rows of `core` cannot be permuted legally, or None (row-wise and dense cores)."""
    spec = getattr(core, "spec", None)
    if spec is not None and spec.layout == "block":
        return (f"{type(core).__name__} is block-wise {spec}: permuting its output rows moves rows between 4x4 "
                f"blocks and breaks their per-column N:4 count; the gather stays")
    return None


def _permute_core_rows(core: nn.Module, perm: torch.Tensor) -> None:
    """W' = W[perm, :] for a row-wise or dense core (values + codes, dense latent with its CAST state, Linear)."""
    assert isinstance(core, (NMSparseLinear, DenseLatentLinear, nn.Linear)), type(core)
    if isinstance(core, NMSparseLinear):
        _take_rows(core.values, perm)
        core.set_codes(core.codes.index_select(0, perm.to(core.codes.device)))
    else:
        _take_rows(core.weight, perm)
        if getattr(core, "mode", None) == "cast":
            _take_rows(core.scale, perm)
            _take_rows(core.codes, perm)
    if core.bias is not None:
        _take_rows(core.bias, perm)


def _permute_branch_output(branch: nn.Module | None, perm: torch.Tensor) -> None:
    """branch'(x, y[..., perm]) = branch(x, y)[..., perm]."""
    if branch is None or isinstance(branch, NoBranch):
        return
    if isinstance(branch, LoRABranch):      # add, add_align, como: delta = (...) B^T; the align cosine is invariant
        _take_rows(branch.lora_B, perm)
    else:                                   # prod_gate: p(x) = 1 + gamma tanh(W2 h + b2), one output per feature
        assert isinstance(branch, ProdGateBranch), type(branch)
        _take_rows(branch.gate.w2, perm)
        _take_rows(branch.gate.b2, perm)


def _permute_branch_input(branch: nn.Module | None, perm: torch.Tensor) -> None:
    """branch'(x[..., perm], y) = branch(x, y): every first layer reading x takes the columns [:, perm]."""
    if branch is None or isinstance(branch, NoBranch):
        return
    if isinstance(branch, LoRABranch):
        _take_columns(branch.lora_A, perm)
        if isinstance(branch, CoMoLoRABranch):
            _take_columns(branch.gate.w1, perm)
    else:
        assert isinstance(branch, ProdGateBranch), type(branch)
        _take_columns(branch.gate.w1, perm)


def _permute_output(module: nn.Module, perm: torch.Tensor) -> None:
    _permute_core_rows(backbone_core(module), perm)
    if isinstance(module, SparseProjection):
        _permute_branch_output(module.branch, perm)


def value_permutation(perm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
                      ) -> tuple[torch.Tensor | None, str]:
    """The row permutation of v_proj [num_kv_heads * head_dim] that makes attention emit a[..., perm], where
    `perm` [num_heads * head_dim] is o_proj's input permutation; (None, reason) when there is none.

    Query head h reads key/value head h // (num_heads / num_kv_heads) (HF `repeat_kv`), so `perm` must keep every
    head's features inside that head and give the heads that share a key/value head the same local permutation."""
    assert perm.numel() == num_heads * head_dim and num_heads % num_kv_heads == 0, (perm.shape, num_heads, head_dim)
    local = perm.view(num_heads, head_dim) - head_dim * torch.arange(num_heads, device=perm.device).unsqueeze(1)
    if bool(((local < 0) | (local >= head_dim)).any()):
        return None, (f"the permutation moves features between attention heads (head_dim {head_dim}): attention "
                      f"would mix them with another head's scores; the gather stays (a block size dividing "
                      f"head_dim keeps blocks within heads)")
    grouped = local.view(num_kv_heads, num_heads // num_kv_heads, head_dim)
    if not bool((grouped == grouped[:, :1]).all()):
        return None, ("query heads sharing one key/value head have different permutations, so no single row "
                      "permutation of v_proj serves them; the gather stays")
    kv_offsets = head_dim * torch.arange(num_kv_heads, device=perm.device).unsqueeze(1)
    return (grouped[:, 0] + kv_offsets).flatten(), ""


def _hard_perm(proj: nn.Module) -> tuple[torch.Tensor | None, str]:
    perm = proj.permutation
    if not perm.all_hard():
        soft = int((~perm.hard_mask).sum())
        return None, f"{soft} of {perm.num_blocks} permutation blocks are still soft; call harden_all() first"
    return perm.perm_indices(), ""


def _drop_permutation(parent: nn.Module, child: str) -> None:
    """Remove the reader's gather; a projection left with neither branch nor permutation becomes its bare core,
    as `sparsify` builds it without permutations (HF parameter names)."""
    proj = getattr(parent, child)
    proj.permutation = None
    if proj.branch is None:
        setattr(parent, child, proj.core)


Writers = dict[str, tuple[nn.Module, torch.Tensor | None]]   # name -> (module, its output row permutation)


def _try_fold(parent: nn.Module, reader: str, writers: Writers, perm: torch.Tensor | None, reason: str,
              dry_run: bool) -> str:
    """Fold `perm`, the input permutation of `parent.reader`, into the writers' output rows and the reader's branch
    input; '' when done (or doable, with `dry_run`), else why not (nothing is changed then)."""
    if reason:
        return reason
    for name, (module, _) in writers.items():
        refusal = _row_fold_refusal(backbone_core(module))
        if refusal is not None:
            return f"{name}: {refusal}"
    if dry_run:
        return ""
    for module, rows in writers.values():
        _permute_output(module, rows)
    _permute_branch_input(getattr(parent, reader).branch, perm)
    _drop_permutation(parent, reader)
    return ""


def _has_permutation(module: nn.Module) -> bool:
    return isinstance(module, SparseProjection) and module.permutation is not None


def fold_permutations(model: nn.Module, dry_run: bool = False) -> dict[str, dict]:
    """Fold every hardened down_proj and o_proj input permutation of a `LlamaForCausalLM` built by `build_model`
    into gate_proj/up_proj and v_proj output rows where exact (module docstring), in place; with `dry_run` only
    report what would fold, changing nothing.

    Returns {"folded": {reader name: [writer names]}, "kept": {projection name: reason}}: every projection that
    had an input permutation appears in exactly one of them. Logits are unchanged up to float rounding."""
    folded: dict[str, list[str]] = {}
    kept: dict[str, str] = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for parent, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            for name in names:
                if _has_permutation(model.get_submodule(f"{parent}.{name}")):
                    kept[f"{parent}.{name}"] = KEPT_SHARED_INPUT.format(group=", ".join(names))

        if _has_permutation(layer.mlp.down_proj):
            perm, reason = _hard_perm(layer.mlp.down_proj)
            writers = {f"{mlp}.gate_proj": (layer.mlp.gate_proj, perm), f"{mlp}.up_proj": (layer.mlp.up_proj, perm)}
            _record(folded, kept, f"{mlp}.down_proj", writers,
                    _try_fold(layer.mlp, "down_proj", writers, perm, reason, dry_run))

        if _has_permutation(layer.self_attn.o_proj):
            perm, reason = _hard_perm(layer.self_attn.o_proj)
            rows = None
            if not reason:
                rows, reason = value_permutation(perm, model.config.num_attention_heads,
                                                 model.config.num_key_value_heads, layer.self_attn.head_dim)
            writers = {f"{attn}.v_proj": (layer.self_attn.v_proj, rows)}
            _record(folded, kept, f"{attn}.o_proj", writers,
                    _try_fold(layer.self_attn, "o_proj", writers, perm, reason, dry_run))
    return {"folded": folded, "kept": kept}


def _record(folded: dict[str, list[str]], kept: dict[str, str], reader: str, writers: Writers, why: str) -> None:
    if why:
        kept[reader] = why
    else:
        folded[reader] = list(writers)
