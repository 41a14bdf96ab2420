"""Op traces of the pieces of one training step of a rank, as an H200 run would ask for them (issue 25 item 5; read by
bench/estimate_h200.py, estimated by distsparse/perf/roofline.py).

What runs where:
  forward+backward   the model of the run (transformers' LlamaForCausalLM with the method's projections, cast to
                     bf16 as DeepSpeed's bf16 mode casts it) on the meta device at the preset's full size, every
                     micro-batch of a step; a sparse row's backbone hooks into the matrix engine's gradient buckets
                     run inside it, with the bucket collectives they start
  backbone step      the matrix engine's phases 1-5 of a steady step (reduce wait, the joint step's local scalar,
                     rule kernels, value gather), on meta, after `WARM_STEPS` untraced steps so every TANS ramp is
                     over (a ramping matrix skips Newton-Schulz)
  refresh            the engine's refresh phase (`MatrixEngine._refresh`: every owned sparse matrix refreshed, state
                     moved, codes distributed) on the CPU with real values (its selection reads counts on the host,
                     which the meta device cannot), at a few layers of the preset's widths: `refresh_per_matrix`
                     extrapolates it per matrix (a refresh is per matrix; bench/estimate_h200.py checks linearity)
  joint scalars      the joint step's one all-reduce of its 4 float64 scalars (joint_step.py phase 2), sparse rows
  dense side         DeepSpeed ZeRO-2's step as a dense user runs it, replayed op by op on meta (DeepSpeed cannot be
                     built on meta): per micro-batch each dense gradient copied into the contiguous bf16 bucket and
                     one all-reduce of it (DeepSpeed 0.19's ZeRO-2 default, use_multi_rank_bucket_allreduce: the
                     real Trainer's trace shows it, tests/test_roofline.py); per step the rank's fp32 partition (numel / W, padded) cast from the
                     bucket, one fused AdamW (DeepSpeed's FusedAdam: one multi-tensor kernel, here
                     `aten._fused_adamw_`), the bf16 parameter partition written back and one all-gather of the
                     parameters. Gradient clipping is off in the paper presets (train.grad_clip 0), so no norm.
Multi-rank layouts come from the engine's own layout code run under `simulated_world` (distsparse/perf/trace.py):
rank r of W builds its engine as on a real launch (owners, buckets, groups, shards) and its collectives are recorded.
GPU behaviour kept on meta (`gpu_like`): Newton-Schulz iterates in bf16 as on CUDA (`newton_schulz`'s CUDA
default); causal attention without a mask in bf16 runs as SDPA's flash kernel (`_scaled_dot_product_flash_attention`
and its backward, one op each, as SDPA picks on an H200) instead of the math fallback a meta or CPU tensor gets
(bmm, softmax, bmm: an [s, s] score matrix in memory); transformers' packed-sequence check on position ids (a host
read of `.all()`, one sync per forward on a GPU) is skipped: it returns None for unpacked batches, as here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from dataclasses import dataclass, field
from unittest import mock

import torch

from distsparse import dist as ddist
from distsparse.perf.trace import CollectiveRecord, OpRecord, OpTracer, simulated_world
from distsparse.train.batch import resolve_batch

WARM_STEPS = 16            # > every preset's TANS ramp_steps (8)
NS_MODULES = ("distsparse.optim.group_rules", "distsparse.optim.rules_tans", "distsparse.optim.rules_muon")


@dataclass
class Trace:
    """The ops and collectives of one traced piece."""
    ops: list[OpRecord] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)

    def __add__(self, other: "Trace") -> "Trace":
        return Trace(self.ops + other.ops, self.collectives + other.collectives)


def _flash_sdpa(original):
    """torch's SDPA as on a GPU: the flash kernel where it applies (no mask, no GQA broadcast, half precision)."""
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or enable_gqa or query.dtype not in (torch.bfloat16, torch.float16):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                   scale=scale)[0]
    return sdpa


@contextlib.contextmanager
def gpu_like():
    """The module docstring's GPU behaviours on meta."""
    import transformers.masking_utils as masking

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(masking, "find_packed_sequence_indices", lambda position_ids: None))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _flash_sdpa(sdpa)))
        for name in NS_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:   # older trees (the "before" figures) lack some of these modules
                continue
            if hasattr(module, "newton_schulz"):
                bf16 = functools.partial(module.newton_schulz, compute_dtype=torch.bfloat16)
                stack.enter_context(mock.patch.object(module, "newton_schulz", bf16))
        yield


@contextlib.contextmanager
def traced(log: list[CollectiveRecord]):
    """An OpTracer whose Trace also takes the collectives appended to `log` while it is active."""
    start = len(log)
    trace = Trace()
    with OpTracer() as tracer:
        yield trace
    trace.ops = tracer.records
    trace.collectives = log[start:]


def meta_model(cfg, vocab_size: int):
    """The run's model on the meta device in bf16, no cache (models/build.py's structure, nothing allocated)."""
    from transformers import LlamaForCausalLM

    from distsparse.models.build import branch_rank, llama_config, sparsify

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(cfg.model, vocab_size))
        sparsify(model, cfg.method, 0, branch_rank(cfg.model, cfg.method))
    model.config.use_cache = False
    return model.to(torch.bfloat16)


def build_engine(cfg, backbone: dict, device: str | torch.device = "meta", micro_batches: int | None = None):
    """The run's matrix engine (trainer.build_matrix_engine's settings) over `backbone`, fp32 masters on `device`;
    `micro_batches` per step (None: train.grad_accum)."""
    from distsparse.models import backbone_param
    from distsparse.optim.engine import MatrixEngine

    initial = {name: backbone_param(m).detach().float() for name, m in backbone.items()}
    e = cfg.engine
    return MatrixEngine(backbone, rule=cfg.method.rule, hparams=cfg.method.rule_params, mode=e.mode,
                        reduce_dtype=e.reduce_dtype, group=None, reset_mode=cfg.method.reset_mode,
                        initial_values=initial, grad_accum_mode=e.grad_accum_mode,
                        micro_batches=micro_batches or cfg.train.grad_accum, num_buckets=e.num_buckets,
                        bucket_bytes=e.bucket_bytes, device=device)


def forward_backward(model, engine, micro_batch: int, seq_len: int, micro_batches: int,
                     log: list[CollectiveRecord]) -> Trace:
    """Every micro-batch of one step: forward with labels and backward (the engine's hooks arm as the joint step
    arms them: the last backward starts the boundary)."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    with traced(log) as trace:
        for i in range(micro_batches):
            if engine is not None:
                (engine.start_boundary if i == micro_batches - 1 else engine.start_micro_step)()
            model(input_ids=ids, labels=ids).loss.backward()
    return trace


def backbone_step(engine, lr: float, grad_clip: float, log: list[CollectiveRecord]) -> Trace:
    """The engine's part of a steady joint step (joint_step.py phases 1, 2 and 4 without refresh), after
    WARM_STEPS untraced steps."""
    for _ in range(WARM_STEPS):
        engine.step(lr)
    with traced(log) as trace:
        engine.reduce_gradients()
        engine.local_grad_sq_norm() if grad_clip > 0 else engine.local_grads_nonfinite()
        engine.step(lr)
        engine.zero_grad()
    return trace


def zero2_dense_step(param_numels: list[int], world_size: int, micro_batches: int,
                     log: list[CollectiveRecord]) -> Trace:
    """DeepSpeed ZeRO-2's dense side of one step (module docstring) for parameters of `param_numels`."""
    total = sum(param_numels)
    part = -(-total // world_size)
    bucket = torch.empty(part * world_size, dtype=torch.bfloat16, device="meta")
    grads = [torch.empty(n, dtype=torch.bfloat16, device="meta") for n in param_numels]
    master, exp_avg, exp_avg_sq = (torch.empty(part, device="meta") for _ in range(3))
    step = torch.zeros((), device="meta")
    with traced(log) as trace:
        for _ in range(micro_batches):
            offset = 0
            for g in grads:
                bucket[offset:offset + g.numel()].copy_(g)
                offset += g.numel()
            torch.distributed.all_reduce(bucket)
        fp32_grad = bucket[:part].float()
        torch._fused_adamw_([master], [fp32_grad], [exp_avg], [exp_avg_sq], [], [step], lr=1e-3, beta1=0.9,
                            beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        bucket[:part].copy_(master)
        torch.distributed.all_gather_into_tensor(bucket, bucket[:part])
    return trace


def rank_traces(cfg, vocab_size: int, world_size: int, rank: int, *, sparse: bool) -> dict:
    """Rank `rank` of `world_size`: its traces of one steady step (forward_backward, backbone_step, dense_step) and
    its engine's layout facts (owned sparse matrices, codes shard bytes); `sparse`: the run has a matrix engine."""
    log: list[CollectiveRecord] = []
    t = cfg.train
    accum = resolve_batch(t, world_size).grad_accum   # train.global_batch_size's accumulation on this world size
    with simulated_world(world_size, rank, log), gpu_like():
        model = meta_model(cfg, vocab_size)
        engine = None
        if sparse:
            from distsparse.models import backbone_modules, backbone_param
            backbone = backbone_modules(model)
            engine = build_engine(cfg, backbone, micro_batches=accum)
            excluded = {id(backbone_param(m)) for m in backbone.values()}
            dense = [p.numel() for p in model.parameters() if id(p) not in excluded]
        else:
            dense = [p.numel() for p in model.parameters()]
        out = {"forward_backward": forward_backward(model, engine, t.micro_batch, cfg.data.seq_len, accum, log)}
        if engine is not None:
            out["backbone_step"] = backbone_step(engine, cfg.method.lr, t.grad_clip, log)
            with traced(log) as out["joint_scalars"]:
                ddist.dist_sum(torch.zeros(4, dtype=torch.float64, device="meta"))
            out["owned_sparse"] = sum(1 for m in engine.owned() if m.sparse)
            out["matrices"] = len(engine.matrices)
            out["codes_gather"] = CollectiveRecord("all_gather", world_size * engine.codes_shard_size)
        out["dense_step"] = zero2_dense_step(dense, world_size, accum, log)
    return out


def refresh_trace(cfg, layers: int, step: int) -> tuple[Trace, int]:
    """(trace, matrices refreshed) of the engine's refresh phase on one rank, CPU, `layers` layers of the preset's
    widths, the model built as the trainer builds it (models.build_model), topology refresh at `step`."""
    from distsparse.models import backbone_modules, build_model
    from distsparse.train.topology_policy import TopologyPolicy

    model = build_model(dataclasses.replace(cfg.model, num_hidden_layers=layers), cfg.method, 512, cfg.train.seed)
    backbone = backbone_modules(model)
    engine = build_engine(cfg, backbone, device="cpu")
    policy = TopologyPolicy(cfg.method.topology, cfg.train.steps, cfg.train.seed)
    log: list[CollectiveRecord] = []
    with traced(log) as trace:
        engine._refresh(policy.refresh_fn(step))   # phase 4 alone: the rule kernels are the steady step's
    return trace, sum(1 for m in engine.matrices.values() if m.sparse)
