"""Named LLaMA sizes as HF `LlamaForCausalLM` (sdpa attention) with their 7 projections swapped by name.

Backbone = the projections q, k, v, o, gate, up, down of every decoder layer. With a sparse method each
becomes an `NMSparseLinear` (compressed values + codes) initialized from a seed derived from (seed, name), so
every rank builds the same topology without communication. Large sizes build on the meta device and
materialize the compressed values directly: no dense fp32 projection ever exists (DESIGN decision 16).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from distsparse.config import MethodConfig, ModelConfig, check_backbone_shapes
from distsparse.layers import NMSparseLinear
from distsparse.layers.branches import build_branch, rank_for_budget
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.layers.llama_projections import PROJECTIONS
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.projection import SparseProjection, backbone_core
from distsparse.utils import stable_seed

REFERENCE_VOCAB = 32000   # branch budgets and reported dense counts use the paper's vocabulary


def llama_config(model_cfg: ModelConfig, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_width,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_attention_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rms_norm_eps=model_cfg.rms_norm_eps,
        initializer_range=model_cfg.initializer_range,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        attn_implementation="sdpa",
    )


def projection_names(model: nn.Module) -> list[str]:
    """Sorted fully qualified names of the backbone projections (every rank gets the same list)."""
    return sorted(name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS)


def backbone_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Projection name -> the engine-owned core module."""
    return {name: backbone_core(model.get_submodule(name)) for name in projection_names(model)}


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _core(old: nn.Linear, method: MethodConfig, name: str, seed: int, init_std: float) -> nn.Module:
    kwargs = dict(bias=old.bias is not None, device=old.weight.device, dtype=torch.float32, init=method.init,
                  init_std=init_std, seed=stable_seed(seed, name))
    if method.backbone == "sparse":
        return NMSparseLinear(old.in_features, old.out_features, method.spec, **kwargs)
    if method.backbone == "dense":
        return old
    try:
        return DenseLatentLinear(old.in_features, old.out_features, method.spec, method.backbone,
                                 **method.latent_args, **kwargs)
    except TypeError as err:
        raise ValueError(f"method.latent_args: {err}") from None


def reference_dense_params(hidden: int, ffn: int, layers: int, tied: bool) -> int:
    """The whole dense model's parameter count at the reference vocab 32000: what a branch budget is a percentage
    of (DESIGN s5). Embedding and head (one matrix when tied), 4 attention and 3 MLP projections and 2 norms per
    layer, the final norm."""
    embeddings = (1 if tied else 2) * REFERENCE_VOCAB * hidden
    return embeddings + layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + hidden


def branch_rank(model_cfg: ModelConfig, method: MethodConfig) -> int:
    """The branch rank: explicit, or the largest whose budgeted parameters (method.branch.budget_counts) fit in
    `budget_percent` of `reference_dense_params` (DESIGN s5: 60m at 1% gives r = 7 counting A and B only)."""
    b = method.branch
    if b.budget_percent == 0:
        return b.rank
    d, ff, layers = model_cfg.hidden_size, model_cfg.ffn_width, model_cfg.num_hidden_layers
    dense = reference_dense_params(d, ff, layers, model_cfg.tie_word_embeddings)
    shapes = [(d, d)] * 4 * layers + [(d, ff)] * 2 * layers + [(ff, d)] * layers
    return rank_for_budget(b.kind, b.budget_percent, dense, shapes, b.hidden, b.budget_counts)


# Projections reading the same input share one permutation (DESIGN decision 12).
PERMUTATION_GROUPS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                      "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}


def _permutation(model: nn.Module, name: str, old: nn.Linear, method: MethodConfig, seed: int,
                 shared: dict[str, BlockPermutation]) -> BlockPermutation | None:
    perm = method.permutation
    if perm.mode == "none":
        return None
    layer, _, proj = name.rpartition(".")
    key = f"{layer.rpartition('.')[0]}.{PERMUTATION_GROUPS[proj]}"
    if key not in shared:
        shared[key] = BlockPermutation(old.in_features, perm.block_size, perm.mode, seed=stable_seed(seed, key),
                                       device=old.weight.device)
    return shared[key]


def sparsify(model: LlamaForCausalLM, method: MethodConfig, seed: int, rank: int = 0) -> None:
    """Swap every projection for the method's backbone layer, with its branch and input permutation when the
    method has them."""
    init_std = model.config.initializer_range
    shared: dict[str, BlockPermutation] = {}
    for name in projection_names(model):
        old = model.get_submodule(name)
        core = _core(old, method, name, seed, init_std)
        branch = None
        if method.branch.kind != "none":
            torch.manual_seed(stable_seed(seed, name, "branch"))
            branch = build_branch(method.branch.kind, old.in_features, old.out_features, rank=rank,
                                  hidden=method.branch.hidden, gamma=method.branch.gamma,
                                  device=old.weight.device)
        permutation = _permutation(model, name, old, method, seed, shared)
        if branch is not None or permutation is not None:
            core = SparseProjection(core, branch, permutation)
        if core is not old:
            _set_submodule(model, name, core)


@torch.no_grad()
def _materialize(model: LlamaForCausalLM, seed: int) -> None:
    """Allocate a meta-built model on CPU and initialize every tensor (HF's scheme for the dense parts)."""
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    for name, module in model.named_modules():
        if isinstance(module, (NMSparseLinear, DenseLatentLinear, BlockPermutation)):
            module.reset_parameters()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std, generator=gen)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, LlamaRMSNorm):
            module.weight.fill_(1.0)
    # RoPE frequencies are non-persistent buffers: to_empty leaves them uninitialized.
    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)


def build_on_meta(model_cfg: ModelConfig, method: MethodConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """The run's model with every tensor on the meta device (shapes and dtypes, no storage): what a meta-device
    build materializes, and what `--dry-run` plans memory from (distsparse/memory_estimate.py) at any size."""
    check_backbone_shapes(model_cfg, method)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(model_cfg, vocab_size))
        sparsify(model, method, seed, branch_rank(model_cfg, method))
    return model


def build_model(model_cfg: ModelConfig, method: MethodConfig, vocab_size: int, seed: int) -> LlamaForCausalLM:
    """The run's model in fp32 on CPU; the caller moves it and DeepSpeed casts it."""
    check_backbone_shapes(model_cfg, method)
    torch.manual_seed(seed)   # identical dense init on every rank (DeepSpeed broadcasts it anyway)
    if model_cfg.meta_device_init:
        model = build_on_meta(model_cfg, method, vocab_size, seed)
        _materialize(model, seed)
    else:
        model = LlamaForCausalLM(llama_config(model_cfg, vocab_size))
        sparsify(model, method, seed, branch_rank(model_cfg, method))
    if model_cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    model.config.use_cache = False
    return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer through the API this transformers has:
    `activation_checkpointing_enable` (5.2x, where `gradient_checkpointing_enable` is a deprecated alias) or
    `gradient_checkpointing_enable` (4.35 .. 5.17, which has no other name). Detected by feature, not by version,
    so that a backport or a removal of the alias needs no change here."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def parameter_counts(model: nn.Module) -> dict[str, int | float]:
    """Active backbone weights, dense-side parameters (embeddings, norms, head, branches) and totals; the branch's
    base (`reference_dense_params` of this model's shape) and its realized share of it in percent, the number a
    `method.branch.budget_percent` is a bound on."""
    backbone = dense_equiv = branch = 0
    for name in projection_names(model):
        outer = model.get_submodule(name)
        if isinstance(outer, SparseProjection) and outer.branch is not None:
            branch += sum(p.numel() for p in outer.branch.parameters())
        mod = backbone_core(outer)
        if isinstance(mod, NMSparseLinear):
            backbone += mod.values.numel()
            dense_equiv += mod.in_features * mod.out_features
        else:
            backbone += mod.weight.numel()
            dense_equiv += mod.weight.numel()
    backbone_ids = {id(backbone_param(backbone_core(model.get_submodule(n)))) for n in projection_names(model)}
    other = sum(p.numel() for p in model.parameters() if id(p) not in backbone_ids)
    cfg = model.config
    base = reference_dense_params(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                                  cfg.tie_word_embeddings)
    return {"backbone_active": backbone, "backbone_dense_equivalent": dense_equiv, "branch": branch,
            "dense_side": other, "total": backbone + other, "total_dense_equivalent": dense_equiv + other,
            "branch_budget_base": base, "branch_percent": 100.0 * branch / base}


def backbone_param(core: nn.Module) -> nn.Parameter:
    """The engine-owned tensor of a core: compressed values, or a dense (latent) weight."""
    return core.values if isinstance(core, NMSparseLinear) else core.weight
