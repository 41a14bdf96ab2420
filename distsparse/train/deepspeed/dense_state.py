"""The dense side's optimizer state by parameter name, independent of the ZeRO partitioning.

ZeRO-1/2 files hold flat per-rank partitions, which DeepSpeed refuses to load on another world size. Saving the
fp32 master and Adam moments of every dense parameter by name (DeepSpeed's `safe_get_full_*` helpers, one
all-reduce each) lets a run resume on W' ranks: load the module, then set each parameter's state back
(research/distributed_ns.md s4.8). The cost is one consolidated copy of the dense side (embeddings, norms,
head, branches) per checkpoint, written by rank 0.
"""

from __future__ import annotations

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state,
)

MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_KEY = "__optimizer_step__"


def _dense_params(ds_engine, model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    owned = {id(p) for group in ds_engine.optimizer.bit16_groups for p in group}
    return [(n, p) for n, p in model.named_parameters() if id(p) in owned]


def _optimizer_step(ds_engine) -> int:
    for state in ds_engine.optimizer.optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def gather_dense_state(ds_engine, model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """Collective. Rank 0 gets {name::master|exp_avg|exp_avg_sq: fp32 tensor} plus the optimizer step."""
    opt = ds_engine.optimizer
    if all(opt.optimizer.state.get(flat) for flat in opt.single_partition_of_fp32_groups):
        # DeepSpeed links the Adam state to the parameters at its first step, also after load_checkpoint: a save
        # before that step (a finished run resumed, save_at_end) links it here. Only once the state exists: a link
        # is a set of views, made to empty state it would stay empty (deepspeed==0.19.8 internal, pinned).
        opt._lazy_init_hp_params_optimizer_state()
    out: dict[str, torch.Tensor] = {}
    for name, p in _dense_params(ds_engine, model):
        full = {"master": safe_get_full_fp32_param(p)}
        for key in MOMENTS:
            full[key] = safe_get_full_optimizer_state(p, key)
        if rank == 0:
            out.update({f"{name}::{k}": v.detach().float().contiguous().cpu() for k, v in full.items() if v is not None})
    if rank != 0:
        return None
    out[STEP_KEY] = torch.tensor(_optimizer_step(ds_engine), dtype=torch.int64)
    return out


def _ensure_optimizer_state(ds_engine) -> None:
    """Create the (lazy) Adam state of the flat fp32 partitions and link it to the parameters, as the first
    optimizer step would, so that safe_set_full_optimizer_state has somewhere to write."""
    opt = ds_engine.optimizer.optimizer
    for group in opt.param_groups:
        for flat in group["params"]:
            if not opt.state[flat]:
                opt.state[flat] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(flat) for k in MOMENTS}}
    ds_engine.optimizer._lazy_init_hp_params_optimizer_state()   # deepspeed==0.19.8 internal (pinned)


def restore_dense_state(ds_engine, model: torch.nn.Module, state: dict[str, torch.Tensor], step: int) -> None:
    """Set masters, moments and step on a freshly initialized engine whose module was just loaded."""
    _ensure_optimizer_state(ds_engine)
    for name, p in _dense_params(ds_engine, model):
        safe_set_full_fp32_param(p, state[f"{name}::master"].to(p.device))
        for key in MOMENTS:
            safe_set_full_optimizer_state(p, state[f"{name}::{key}"].to(p.device), key)
    opt_step = state[STEP_KEY]
    for opt_state in ds_engine.optimizer.optimizer.state.values():
        if "step" in opt_state:
            opt_state["step"] = opt_step.clone().to(opt_state["step"].dtype) if torch.is_tensor(opt_state["step"]) \
                else int(opt_step)
    # Counters and the LR schedule are pure functions of the step (schedule.lr_factor).
    ds_engine.global_steps = step
    ds_engine.global_samples = step * ds_engine.train_batch_size()
    sched = ds_engine.lr_scheduler
    sched.last_epoch = step - 1
    sched.step()
