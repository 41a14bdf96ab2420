"""Bytes per rank by part, from a model's shapes and the engine's own layout rules: the arithmetic behind
`distsparse-train --dry-run` and the analytic columns of bench/scale_check.py (which measures the same parts on a
real run and checks this against it). Nothing here starts a process group or allocates a model-sized tensor: the
shapes come from a model built on the meta device (`build_on_meta`).

Parts (DESIGN s6; bench/scale_check.py's docstring says how each is measured):
  dense side (DeepSpeed ZeRO-1/2 AdamW: embeddings, norms, LM head, branches), per parameter group of n params:
    module_copy      n x dtype bytes (DeepSpeed casts the module to bf16 when training in bf16)
    fp32_partition   4 x ceil(n / W)
    moments          8 x ceil(n / W) (exp_avg, exp_avg_sq), + 4 bytes of step counter per group with torch Adam
    grad_partition   ZeRO-2: dtype x ceil(n / W) (DeepSpeed accumulates in the module's dtype by default);
                     ZeRO-1: dtype x n (gradients are not partitioned: every one is held until the boundary)
  backbone (the matrix engine)
    values           kept weights x dtype bytes, on every rank
    codes            the packed uint8 codes the layers hold, on every rank
    index_cache      0 (the flat index is derived from the codes per call, issue 19)
    optimizer_state  fp32 master + the rule's `init_state` tensors of the matrices this rank updates (its own, by
                     LPT on `matrix_cost`; every matrix in replicated mode)
    origin_codes     the step-0 codes of the sparse matrices this rank updates, for links_ever_changed
                     (topology/origin.py): their codes' bytes again, once over the world when sharded
    grad_buffer      persistent fp32 gradients (`grad_buckets.grad_bytes` of the engine's `bucket_layout`)
  transient (held during a step, not between steps)
    grad_staging     the engine's gradient staging, wire copies and reduce outputs at their peak
    value_gather     the engine's value all-gather staging: send [chunk] + receive [W x chunk], chunk <= 2^24
    reduce_bucket    DeepSpeed's reduce bucket, touched up to min(reduce_bucket_size, dense-side params) elements
  activations        Korthikanti et al. 2022 (arXiv:2205.05198, eq. 2), bf16, no dropout-free correction:
                     per layer s*b*h*(34 + 5*a*s/h) bytes without activation checkpointing, ~2*s*b*h bytes (the
                     layer's saved input) with model.activation_checkpointing
  decompressed_weights  the dense W each sparse projection's forward keeps for its backward (layers/nm_linear.py:
                     no second decompression), dtype x out x in, and the int32 key it was built from saved beside it
                     (4 B per kept value; the models' widths always tile whole bags): every layer's without
                     activation checkpointing, one layer's (the layer being recomputed) with it
Not counted: buffers inside the collectives, the logits and loss, and the allocator's fragmentation.
"""

from __future__ import annotations

import math
from typing import Any

import torch.nn as nn

from distsparse.config import Config, MethodConfig, load_config
from distsparse.layers import NMSparseLinear
from distsparse.models import backbone_modules, backbone_param, build_on_meta
from distsparse.optim.engine import GATHER_CHUNK
from distsparse.optim.grad_buckets import BUCKET_BYTES, align, bucket_layout, grad_bytes, resolve_grad_accum_mode
from distsparse.optim.owners import assign_owners, matrix_cost
from distsparse.optim.rules import init_state
from distsparse.train.batch import resolve_batch

DENSE_PARTS = ("module_copy", "fp32_partition", "moments", "grad_partition")
BACKBONE_PARTS = ("values", "codes", "index_cache", "optimizer_state", "origin_codes", "grad_buffer")
TRANSIENT_PARTS = ("grad_staging", "value_gather", "reduce_bucket")
DS_REDUCE_BUCKET = 500_000_000   # DeepSpeed's default zero_optimization.reduce_bucket_size (elements)
ADAM_STEP_BYTES = 4              # torch Adam's fp32 step counter tensor per parameter group


# ---- shapes ------------------------------------------------------------------------------------------------------

def backbone_matrices(model: nn.Module) -> dict[str, dict[str, Any]]:
    """name -> dense frame (out, in), engine parameter shape and the bytes of the codes the layer holds (0 for a
    dense layer), read from a model (meta-built or real)."""
    out = {}
    for name, module in backbone_modules(model).items():
        codes = module.codes if isinstance(module, NMSparseLinear) else None
        out[name] = {"frame": (module.out_features, module.in_features), "param": tuple(backbone_param(module).shape),
                     "codes": 0 if codes is None else codes.numel() * codes.element_size()}
    return out


def preset_matrices(model: str, method: str) -> dict[str, dict[str, Any]]:
    """`backbone_matrices` of a model preset under a method preset, built on the meta device."""
    cfg = load_config(None, [f"model.preset={model}", f"method.preset={method}"])
    return backbone_matrices(build_on_meta(cfg.model, cfg.method, cfg.model.vocab_size or 32000, cfg.train.seed))


def dense_matrices(matrices: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The same frames as dense weights (dense AdamW's backbone)."""
    return {name: {"frame": m["frame"], "param": m["frame"], "codes": 0} for name, m in matrices.items()}


def method_config(method: str) -> MethodConfig:
    return load_config(None, [f"method.preset={method}"]).method


# ---- backbone ----------------------------------------------------------------------------------------------------

def matrix_owners(matrices: dict[str, dict[str, Any]], method: MethodConfig, world_size: int) -> dict[str, int]:
    """The engine's owner map: LPT (`assign_owners`) on `matrix_cost` for `method`'s rule."""
    rule, ns_steps = method.rule, getattr(method.rule_params, "ns_steps", 5)
    return assign_owners({name: matrix_cost(rule, tuple(m["frame"]), math.prod(m["param"]), ns_steps)
                          for name, m in matrices.items()}, world_size)


def backbone_analytic(matrices: dict[str, dict[str, Any]], method: MethodConfig, world_size: int, mode: str, *,
                      values_bytes: int = 4, num_buckets: int = 1, bucket_bytes: int = BUCKET_BYTES,
                      replicated: bool = False, micro_batches: int = 1, reduce_itemsize: int = 4
                      ) -> list[dict[str, int]]:
    """Per rank, the backbone's bytes by part (BACKBONE_PARTS and `grad_transient_peak`) from the shapes alone, by
    the engine's own rules: `matrix_owners`, the gradient layout of accumulation `mode` (`bucket_layout`:
    `num_buckets` in full mode, `bucket_bytes` in sharded) and `grad_bytes` (a reduce dtype narrower than fp32
    travels as a wire copy); fp32 masters and `init_state`'s tensors for the matrices a rank updates (its own, or
    every one when `replicated`)."""
    numel = {name: math.prod(m["param"]) for name, m in matrices.items()}
    owners = matrix_owners(matrices, method, world_size)
    sizing = {"num_buckets": num_buckets} if mode == "full" else {"bucket_bytes": bucket_bytes}
    layout = bucket_layout(numel, owners, world_size, **sizing)
    state, origin = [0] * world_size, [0] * world_size
    for name, m in matrices.items():
        tensors = init_state(method.rule, tuple(m["param"]), "meta").values()
        held = 4 * numel[name] + sum(t.numel() * t.element_size() for t in tensors)
        for rank in range(world_size) if replicated else (owners[name],):
            state[rank] += held
            origin[rank] += m["codes"]
    values = values_bytes * sum(numel.values())
    codes = sum(m["codes"] for m in matrices.values())
    ranks = []
    for rank in range(world_size):
        grads = grad_bytes(layout, rank, world_size, mode, micro_batches=micro_batches,
                           reduce_itemsize=reduce_itemsize, wire_copy=reduce_itemsize != 4)
        ranks.append({"values": values, "codes": codes, "index_cache": 0, "optimizer_state": state[rank],
                      "origin_codes": origin[rank],
                      "grad_buffer": grads["persistent"], "grad_transient_peak": grads["transient_peak"]})
    return ranks


def value_gather_bytes(matrices: dict[str, dict[str, Any]], method: MethodConfig, world_size: int,
                       values_bytes: int = 4, replicated: bool = False) -> int:
    """The engine's value all-gather staging (MatrixEngine._distribute_values): send [chunk] and receive
    [W x chunk] in the values' dtype, chunk = min(GATHER_CHUNK, the aligned largest shard); none in one process
    or in replicated mode."""
    if world_size == 1 or replicated:
        return 0
    fill = [0] * world_size
    for name, owner in matrix_owners(matrices, method, world_size).items():
        fill[owner] += math.prod(matrices[name]["param"])
    return (world_size + 1) * min(GATHER_CHUNK, align(max(fill))) * values_bytes


def state_parts(analytic: dict[str, int]) -> dict[str, int]:
    return {part: analytic[part] for part in BACKBONE_PARTS}


# ---- dense side and activations ----------------------------------------------------------------------------------

def dense_side_analytic(group_params: list[int], world_size: int, stage: int, dtype_bytes: int = 4,
                        step_bytes: int = ADAM_STEP_BYTES) -> dict[str, int]:
    """DeepSpeed ZeRO-`stage` AdamW state of one rank for parameter groups of `group_params` parameters (each group
    is flattened and partitioned over the W ranks on its own)."""
    if stage not in (1, 2):
        raise ValueError(f"zero_optimization.stage: got {stage}; allowed: 1, 2")
    n, part = sum(group_params), sum(math.ceil(g / world_size) for g in group_params)
    return {"module_copy": dtype_bytes * n, "fp32_partition": 4 * part,
            "moments": 8 * part + step_bytes * len(group_params),
            "grad_partition": dtype_bytes * (part if stage == 2 else n)}


def classic_zero2_bytes(num_params: int, world_size: int, dtype_bytes: int = 4) -> int:
    """Every parameter in DeepSpeed ZeRO-2 AdamW: module copy + fp32 partition, moments and gradient partition."""
    return dtype_bytes * num_params + (4 + 8 + 4) * math.ceil(num_params / world_size)


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, layers: int,
                     checkpointing: bool) -> int:
    """bf16 activations held for backward (module docstring: Korthikanti et al. 2022)."""
    sbh = seq_len * micro_batch * hidden
    per_layer = 2 * sbh if checkpointing else sbh * 34 + 5 * heads * seq_len * seq_len * micro_batch
    return layers * per_layer


def decompressed_weight_bytes(matrices: dict[str, dict[str, Any]], layers: int, checkpointing: bool,
                              dtype_bytes: int) -> int:
    """The dense weights and int32 keys the sparse layers hold from forward to backward (module docstring)."""
    total = sum(dtype_bytes * m["frame"][0] * m["frame"][1] + 4 * m["param"][0] * m["param"][1]
                for m in matrices.values() if m["codes"])
    return total // layers if checkpointing else total


# ---- tables ------------------------------------------------------------------------------------------------------

def scale_table(matrices: dict[str, dict[str, Any]], method: str, dense_method: str, world_sizes: tuple[int, ...],
                modes: tuple[str, ...], num_buckets: int = 1) -> dict[str, dict[str, float]]:
    """The largest rank's backbone bytes at each W of `world_sizes` in each accumulation mode of `modes` (full
    first), beside dense AdamW's (`dense_method` on `dense_matrices`) in the same mode; `grad_over_full_mode`:
    gradient bytes (persistent, and with the transient peak) over the first mode's at the same W."""
    sparse_method, dense = method_config(method), method_config(dense_method)
    table = {}
    for w in world_sizes:
        full = None
        for mode in modes:
            sparse = backbone_analytic(matrices, sparse_method, w, mode, num_buckets=num_buckets)
            reference = backbone_analytic(dense_matrices(matrices), dense, w, mode, num_buckets=num_buckets)
            row = {key: max(r[key] for r in sparse) for key in ("grad_buffer", "grad_transient_peak")}
            row["backbone_state"] = max(sum(state_parts(r).values()) for r in sparse)
            row["dense_adamw_backbone_state"] = max(sum(state_parts(r).values()) for r in reference)
            row["backbone_state_over_dense_adamw"] = row["backbone_state"] / row["dense_adamw_backbone_state"]
            full = full or row
            row["grad_over_full_mode"] = row["grad_buffer"] / full["grad_buffer"]
            row["grad_with_transient_over_full_mode"] = (row["grad_buffer"] + row["grad_transient_peak"]) / (
                full["grad_buffer"] + full["grad_transient_peak"])
            table[f"W={w} {mode}"] = row
    return table


# ---- a run's plan ------------------------------------------------------------------------------------------------

def estimate_run(model: nn.Module, cfg: Config, ds_config: dict, world_size: int) -> dict[str, Any]:
    """Bytes by part on every rank of a `world_size`-rank run of `cfg` under the completed DeepSpeed config
    `ds_config` (build_ds_config), from `model` (meta-built: only shapes are read). `ranks[r]` holds the parts of
    rank r grouped as dense_side, backbone, transient and activations."""
    from distsparse.train.trainer import dense_side_parameters   # the trainer's rule for what DeepSpeed gets

    dtype_bytes = 2 if ds_config.get("bf16", {}).get("enabled") else 4
    zero = ds_config["zero_optimization"]
    stage = zero["stage"]
    backbone = backbone_modules(model)
    groups = dense_side_parameters(model, backbone, branch_lr=cfg.method.branch_lr,
                                   branch_weight_decay=cfg.method.branch_weight_decay)
    group_params = [sum(p.numel() for p in g["params"]) for g in groups]
    torch_adam = ds_config.get("optimizer", {}).get("params", {}).get("torch_adam", False)
    dense = dense_side_analytic(group_params, world_size, stage, dtype_bytes, ADAM_STEP_BYTES if torch_adam else 0)
    replicated = cfg.engine.mode == "replicated"
    accum = resolve_batch(cfg.train, world_size).grad_accum   # train.global_batch_size's accumulation at this W
    mode = resolve_grad_accum_mode(cfg.engine.grad_accum_mode, replicated=replicated, world_size=world_size,
                                   micro_batches=accum)
    shapes = backbone_matrices(model)
    matrices = backbone_analytic(shapes, cfg.method, world_size, mode, values_bytes=dtype_bytes,
                                 num_buckets=cfg.engine.num_buckets, bucket_bytes=cfg.engine.bucket_bytes,
                                 replicated=replicated, micro_batches=accum,
                                 reduce_itemsize=2 if cfg.engine.reduce_dtype == "bf16" else 4)
    gather = value_gather_bytes(shapes, cfg.method, world_size, dtype_bytes, replicated)
    reduce_bucket = dtype_bytes * min(int(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET)), sum(group_params))
    m = cfg.model
    # The formula counts bf16 bytes; fp32 training holds the same tensors at twice the size.
    activations = activation_bytes(cfg.data.seq_len, cfg.train.micro_batch, m.hidden_size, m.num_attention_heads,
                                   m.num_hidden_layers, m.activation_checkpointing) * dtype_bytes // 2
    ranks = [{"dense_side": dense, "backbone": state_parts(r),
              "transient": {"grad_staging": r["grad_transient_peak"], "value_gather": gather,
                            "reduce_bucket": reduce_bucket},
              "activations": {"activations": activations, "decompressed_weights": decompressed_weight_bytes(
                  shapes, m.num_hidden_layers, m.activation_checkpointing, dtype_bytes)}} for r in matrices]
    return {"world_size": world_size, "dtype": "bf16" if dtype_bytes == 2 else "fp32", "zero_stage": stage,
            "grad_accum_mode": mode, "engine_mode": cfg.engine.mode, "micro_batch": cfg.train.micro_batch,
            "grad_accum": accum, "seq_len": cfg.data.seq_len,
            "activation_checkpointing": m.activation_checkpointing, "ranks": ranks}


def rank_total(rank: dict[str, dict[str, int]]) -> int:
    return sum(sum(side.values()) for side in rank.values())


def format_estimate(estimate: dict[str, Any]) -> str:
    """The plan as a table in MiB: every part on the largest rank (by total), and its least and most over ranks."""
    ranks = estimate["ranks"]
    largest = max(range(len(ranks)), key=lambda r: (rank_total(ranks[r]), -r))
    head = (f"memory per rank at W = {estimate['world_size']} ({estimate['dtype']}, ZeRO-{estimate['zero_stage']} "
            f"dense side, engine {estimate['engine_mode']}, gradients {estimate['grad_accum_mode']}, micro-batch "
            f"{estimate['micro_batch']} x seq {estimate['seq_len']}, accumulation {estimate['grad_accum']}, "
            f"activation checkpointing "
            f"{'on' if estimate['activation_checkpointing'] else 'off'})")
    header = f"{'part (MiB)':30s} {f'rank {largest} (largest)':>18s} {'min over ranks':>16s} {'max over ranks':>16s}"
    lines = [head, header]
    for side, parts in ranks[largest].items():
        for part in parts:
            values = [r[side][part] for r in ranks]
            lines.append(f"{side + '/' + part:30s} {parts[part] / 2**20:18.1f} {min(values) / 2**20:16.1f} "
                         f"{max(values) / 2**20:16.1f}")
    totals = [rank_total(r) for r in ranks]
    lines.append(f"{'total':30s} {totals[largest] / 2**20:18.1f} {min(totals) / 2**20:16.1f} "
                 f"{max(totals) / 2**20:16.1f}")
    return "\n".join(lines)
