"""Sequential layer-by-layer one-shot N:M pruning of a Hugging Face LLaMA (research/permutations_pruning.md s5,
s8.B/C; ShuffleSparse seed s3.3 and Algorithm 1 for the permutation).

Owns the calibration driver of Wanda's and SparseGPT's reference code: capture the inputs of decoder layer 0
for every calibration sequence, then for each layer (1) run it densely with forward hooks that gather each
projection's input statistic (Wanda: column norms; SparseGPT: H = 2 X X^T / n), (2) choose one input
permutation per group of projections that read the same tensor (q/k/v, o, gate/up, down): identity, fixed
random, or learned (learned_permutation.py), (3) prune every projection to row-wise N:4 in permuted
coordinates, and (4) re-run the pruned layer to produce the next layer's inputs. The weights written back
are in the ORIGINAL column order (W_orig = W_s[:, inverse(perm)]), so the model stays an exact plain
`LlamaForCausalLM`; its N:M groups are contiguous only in permuted coordinates, W_orig[:, perm].
Nothing here parses arguments or writes files (tools/prune_oneshot.py does).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from distsparse.nm import NMSpec
from distsparse.pruning.learned_permutation import (
    LearnedPermutations, PermGroup, PermutationConfig, cosine_loss, inverse_permutation, learn_permutations,
    random_block_permutation,
)
from distsparse.pruning.sparsegpt import HessianStats, sparsegpt_prune
from distsparse.pruning.wanda import ColumnNormStats, magnitude_scores, prune_by_scores, wanda_scores

log = logging.getLogger(__name__)

METHODS = ("magnitude", "wanda", "sparsegpt")
PERMUTATIONS = ("none", "random", "learned")
# Projections that read the same tensor share one input permutation (PermLLM's perm_qkv / perm_up).
INPUT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o", ("self_attn.o_proj",)),
    ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    ("down", ("mlp.down_proj",)),
)


@dataclass
class PruneConfig:
    """One-shot pruning settings; every field is a flag of tools/prune_oneshot.py (given in brackets)."""

    method: str                   # magnitude | wanda | sparsegpt [--method]
    n: int = 2                    # weights kept per group of 4 input columns [--nm N:4]
    permutation: str = "none"     # none | random | learned [--permutation]
    blocksize: int = 128          # SparseGPT column block [--blocksize]
    percdamp: float = 0.01        # SparseGPT damping, fraction of mean(diag H) [--percdamp]
    batch_size: int = 8           # sequences per layer forward [--batch-size]
    seed: int = 0                 # random permutations and the permutation mini-batches [--seed]
    perm: PermutationConfig = field(default_factory=PermutationConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method (--method): got {self.method!r}; allowed: {', '.join(METHODS)}")
        if self.permutation not in PERMUTATIONS:
            raise ValueError(f"permutation (--permutation): got {self.permutation!r}; "
                             f"allowed: {', '.join(PERMUTATIONS)}")
        NMSpec(self.n)
        if self.batch_size <= 0:
            raise ValueError(f"batch_size (--batch-size): got {self.batch_size}; allowed: a positive integer")


@dataclass
class PruneResult:
    """masks: module name -> bool [out, in] keep mask in permuted coordinates (row-wise N:4 legal; for
    SparseGPT a kept weight may be exactly zero, so this, not the nonzeros, is the pattern).
    perms: module name -> int64 [in] input permutation (absent without permutations): the layer computes
    F.linear(x[..., perm], W[:, perm]) and W[:, perm] has the N:4 groups.
    layers: one dict of measurements per decoder layer.
    stack: the learning summary of the whole-stack objective (None with any other setting)."""

    masks: dict[str, torch.Tensor]
    perms: dict[str, torch.Tensor]
    layers: list[dict[str, Any]]
    stack: dict[str, Any] | None = None


class _Captured(Exception):
    """Raised by the layer-0 pre-hook to stop the forward once the layer inputs are caught."""


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers


def check_model(model: torch.nn.Module, cfg: PruneConfig) -> None:
    """Raise ValueError before any work if `model` is not a LLaMA-style decoder with the seven projections,
    or a projection width does not fit N:4 groups or the permutation blocks."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    names = [name for _, group in INPUT_GROUPS for name in group]
    if layers is None or not all(isinstance(_submodule(layer, name), torch.nn.Linear)
                                 for layer in layers for name in names):
        raise ValueError(f"model: got {type(model).__name__}; allowed: a LLaMA-architecture causal LM "
                         f"(model.model.layers[i] with nn.Linear {', '.join(names)})")
    spec = NMSpec(cfg.n)
    for index, layer in enumerate(layers):
        for name in names:
            linear = layer.get_submodule(name)
            spec.check_shape(linear.out_features, linear.in_features, name=f"model.layers.{index}.{name}")
            if cfg.permutation != "none":
                cfg.perm.check_width(linear.in_features, f"model.layers.{index}.{name}")


def _submodule(module: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def capture_layer_inputs(model: torch.nn.Module, input_ids: torch.Tensor,
                         batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """(hidden states entering decoder layer 0 [nsamples, T, d], the keyword arguments the layers receive).

    The keyword arguments (rotary cos/sin, position ids, causal mask or None) are taken from a one-sequence
    call: they do not depend on the batch and broadcast over any batch size.
    """
    layer0 = decoder_layers(model)[0]
    device = next(model.parameters()).device
    caught: dict[str, Any] = {}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        caught["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        caught["kwargs"] = kwargs
        raise _Captured

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    chunks = []
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            try:
                model.model(input_ids=input_ids[start:start + batch_size].to(device), use_cache=False)
            except _Captured:
                chunks.append(caught["hidden"])
        try:
            model.model(input_ids=input_ids[:1].to(device), use_cache=False)
        except _Captured:
            kwargs = caught["kwargs"]
    finally:
        handle.remove()
    return torch.cat(chunks), kwargs


def layer_forward(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any],
                  weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One decoder layer on `hidden`, with projection weights replaced by `weights` (local name -> W)."""
    if not weights:
        return layer(hidden, **kwargs)
    params = {f"{name}.weight": w for name, w in weights.items()}
    return functional_call(layer, params, (hidden,), kwargs)


@torch.no_grad()
def run_layer(layer: torch.nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any], batch_size: int,
              out: torch.Tensor) -> torch.Tensor:
    """Fill `out` with the layer's outputs on `inputs`, `batch_size` sequences at a time."""
    for start in range(0, inputs.shape[0], batch_size):
        out[start:start + batch_size] = layer(inputs[start:start + batch_size], **kwargs)
    return out


def _new_stats(method: str, linear: torch.nn.Linear) -> ColumnNormStats | HessianStats | None:
    """The input statistic `method` prunes with (magnitude needs none)."""
    if method == "sparsegpt":
        return HessianStats(linear.in_features, linear.weight.device)
    if method == "wanda":
        return ColumnNormStats(linear.in_features, linear.weight.device)
    return None


def _scales(method: str, stats: ColumnNormStats | HessianStats | None, linear: torch.nn.Linear) -> torch.Tensor:
    """Per-column activation scale s of the score |W| diag(s): ones for magnitude pruning."""
    if method == "magnitude":
        return torch.ones(linear.in_features, device=linear.weight.device)
    return stats.col_norms()


@torch.no_grad()
def prune_linear(linear: torch.nn.Linear, method: str, stats: ColumnNormStats | HessianStats | None,
                 perm: torch.Tensor | None, cfg: PruneConfig) -> torch.Tensor:
    """Prune `linear.weight` in place to n:4 in the coordinates of `perm` (None: the identity), written back
    in the original column order; returns the bool keep mask in permuted coordinates."""
    weight = linear.weight.data
    if perm is not None:
        perm = perm.to(weight.device)
    w_perm = weight if perm is None else weight[:, perm]
    if method == "sparsegpt":
        hessian = stats.hessian()
        if perm is not None:
            hessian = hessian[perm][:, perm]
        pruned, mask = sparsegpt_prune(w_perm, hessian, cfg.n, cfg.blocksize, cfg.percdamp)
    else:
        scores = magnitude_scores(w_perm) if method == "magnitude" else wanda_scores(
            w_perm, stats.col_norms() if perm is None else stats.col_norms()[perm])
        pruned, mask = prune_by_scores(w_perm, scores, cfg.n)
    weight.copy_(pruned if perm is None else pruned[:, inverse_permutation(perm)])
    return mask


def _layer_groups(layer: torch.nn.Module, prefix: str, scales: dict[str, torch.Tensor]) -> list[PermGroup]:
    groups = []
    for key, names in INPUT_GROUPS:
        linears = [layer.get_submodule(name) for name in names]
        groups.append(PermGroup(f"{prefix}{key}", [f"{prefix}{name}" for name in names],
                                [lin.weight for lin in linears], [scales[f"{prefix}{name}"] for name in names]))
    return groups


def _local(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: w for name, w in weights.items() if name.startswith(prefix)}


def _sample_batch(num_samples: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_samples, generator=generator)[:batch_size]


@torch.no_grad()
def _mean_cosine_loss(forward, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> float:
    """Token mean of 1 - cos over all samples, `forward(start, stop)` giving the outputs of a slice."""
    total = 0.0
    for start in range(0, inputs.shape[0], batch_size):
        stop = start + batch_size
        total += float(cosine_loss(forward(start, stop), targets[start:stop])) * inputs[start:stop].shape[0]
    return total / inputs.shape[0]


def _learn_layer(layer: torch.nn.Module, prefix: str, inputs: torch.Tensor, targets: torch.Tensor,
                 kwargs: dict[str, Any], scales: dict[str, torch.Tensor], cfg: PruneConfig,
                 generator: torch.Generator) -> LearnedPermutations:
    """Algorithm 1 with the per-layer objective: cosine between this layer's pruned and dense outputs."""
    def loss_fn(weights: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        idx = _sample_batch(inputs.shape[0], cfg.perm.batch_size, generator).to(inputs.device)
        return cosine_loss(layer_forward(layer, inputs[idx], kwargs, _local(weights, prefix)), targets[idx])

    def full_loss_fn(weights: dict[str, torch.Tensor]) -> float:
        local = _local(weights, prefix)
        return _mean_cosine_loss(lambda a, b: layer_forward(layer, inputs[a:b], kwargs, local),
                                 inputs, targets, cfg.batch_size)

    return learn_permutations(_layer_groups(layer, prefix, scales), loss_fn, full_loss_fn, cfg.n, cfg.perm,
                              generator)


def _stack_forward(layers: torch.nn.ModuleList, hidden: torch.Tensor, kwargs: dict[str, Any],
                   weights: dict[str, torch.Tensor]) -> torch.Tensor:
    for index, layer in enumerate(layers):
        hidden = layer_forward(layer, hidden, kwargs, _local(weights, f"model.layers.{index}."))
    return hidden


def _learn_stack(model: torch.nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any], cfg: PruneConfig,
                 generator: torch.Generator) -> LearnedPermutations:
    """Algorithm 1 with the whole-stack objective (PermLLM's): one dense pass gathers every projection's
    activation scales and the last layer's output; then all layers' permutations train jointly against it.
    The sequential driver then prunes with these permutations fixed, each layer with its own statistics."""
    layers = decoder_layers(model)
    scales: dict[str, torch.Tensor] = {}
    hidden = inputs.clone()
    for index, layer in enumerate(layers):
        prefix = f"model.layers.{index}."
        # Column norms suffice for every method here: SparseGPT's Hessian is only needed to prune.
        stats, handles = {}, []
        for _, names in INPUT_GROUPS:
            for name in names:
                linear = layer.get_submodule(name)
                stats[name] = ColumnNormStats(linear.in_features, linear.weight.device)
                handles.append(linear.register_forward_hook(lambda m, a, o, st=stats[name]: st.add(a[0])))
        run_layer(layer, hidden, kwargs, cfg.batch_size, hidden)
        for handle in handles:
            handle.remove()
        for name, st in stats.items():
            scales[prefix + name] = _scales(cfg.method, st, layer.get_submodule(name))
    targets = hidden
    groups = [g for index, layer in enumerate(layers) for g in _layer_groups(layer, f"model.layers.{index}.", scales)]

    def loss_fn(weights: dict[str, torch.Tensor], step: int) -> torch.Tensor:
        idx = _sample_batch(inputs.shape[0], cfg.perm.batch_size, generator).to(inputs.device)
        return cosine_loss(_stack_forward(layers, inputs[idx], kwargs, weights), targets[idx])

    def full_loss_fn(weights: dict[str, torch.Tensor]) -> float:
        return _mean_cosine_loss(lambda a, b: _stack_forward(layers, inputs[a:b], kwargs, weights),
                                 inputs, targets, cfg.batch_size)

    return learn_permutations(groups, loss_fn, full_loss_fn, cfg.n, cfg.perm, generator)


def _summary(learned: LearnedPermutations) -> dict[str, Any]:
    return {"loss_identity": learned.loss_identity, "loss_learned": learned.loss_learned,
            "used_learned": learned.used_learned, "moved_fraction": learned.moved_fraction}


@torch.no_grad()
def _advance(layer: torch.nn.Module, inputs: torch.Tensor, outputs: torch.Tensor, kwargs: dict[str, Any],
             batch_size: int) -> float:
    """Overwrite `outputs` (the dense outputs) with the pruned layer's outputs, which feed the next layer;
    returns ||Y_pruned - Y_dense||^2 / ||Y_dense||^2 over all samples."""
    err, ref = 0.0, 0.0
    for start in range(0, inputs.shape[0], batch_size):
        stop = start + batch_size
        pruned = layer(inputs[start:stop], **kwargs)
        err += float((pruned.float() - outputs[start:stop].float()).pow(2).sum())
        ref += float(outputs[start:stop].float().pow(2).sum())
        outputs[start:stop] = pruned
    return err / max(ref, 1e-30)


@torch.no_grad()
def prune_model(model: torch.nn.Module, input_ids: torch.Tensor, cfg: PruneConfig) -> PruneResult:
    """Prune every projection of every decoder layer of `model` (an HF LlamaForCausalLM, modified in place,
    gradients switched off) to row-wise cfg.n:4 using the calibration sequences `input_ids` [nsamples, T]."""
    check_model(model, cfg)
    model.eval()
    model.requires_grad_(False)
    layers = decoder_layers(model)
    generator = torch.Generator().manual_seed(cfg.seed)
    inputs, kwargs = capture_layer_inputs(model, input_ids, cfg.batch_size)
    outputs = torch.empty_like(inputs)
    result = PruneResult({}, {}, [])

    learn_here = cfg.permutation == "learned" and cfg.perm.objective == "layer"
    stack_perms: dict[str, torch.Tensor] = {}
    if cfg.permutation == "learned" and cfg.perm.objective == "stack":
        start = time.perf_counter()
        learned = _learn_stack(model, inputs, kwargs, cfg, generator)
        stack_perms, result.stack = learned.perms, _summary(learned)
        log.info("stack permutations: loss identity %.5f, learned %.5f, kept %s (%.1fs)", learned.loss_identity,
                 learned.loss_learned, "learned" if learned.used_learned else "identity", time.perf_counter() - start)

    for index, layer in enumerate(layers):
        start = time.perf_counter()
        prefix = f"model.layers.{index}."
        linears = {name: layer.get_submodule(name) for _, names in INPUT_GROUPS for name in names}
        stats = {name: _new_stats(cfg.method, lin) for name, lin in linears.items()}
        handles = [lin.register_forward_hook(lambda m, a, o, st=stats[name]: st.add(a[0]))
                   for name, lin in linears.items() if stats[name] is not None]
        run_layer(layer, inputs, kwargs, cfg.batch_size, outputs)     # dense outputs: the hooks fire here
        for handle in handles:
            handle.remove()

        report: dict[str, Any] = {"layer": index}
        if cfg.permutation == "random":
            perms = {key: random_block_permutation(linears[names[0]].in_features, cfg.perm.block_size, generator)
                     for key, names in INPUT_GROUPS}
        elif learn_here:
            scales = {prefix + name: _scales(cfg.method, stats[name], lin) for name, lin in linears.items()}
            learned = _learn_layer(layer, prefix, inputs, outputs, kwargs, scales, cfg, generator)
            perms = {key: learned.perms[prefix + key] for key, _ in INPUT_GROUPS}
            report.update(_summary(learned))
        else:
            perms = {key: stack_perms[prefix + key] for key, _ in INPUT_GROUPS if prefix + key in stack_perms}

        for key, names in INPUT_GROUPS:
            for name in names:
                perm = perms.get(key)
                result.masks[prefix + name] = prune_linear(linears[name], cfg.method, stats[name], perm, cfg).cpu()
                if perm is not None:
                    result.perms[prefix + name] = perm.cpu().clone()
        del stats

        report["rel_output_error"] = _advance(layer, inputs, outputs, kwargs, cfg.batch_size)
        inputs, outputs = outputs, inputs
        report["seconds"] = time.perf_counter() - start
        result.layers.append(report)
        log.info("layer %d/%d: rel output error %.4g%s (%.1fs)", index + 1, len(layers), report["rel_output_error"],
                 f", perm loss identity {report['loss_identity']:.5f} learned {report['loss_learned']:.5f}"
                 if learn_here else "", report["seconds"])
    return result
