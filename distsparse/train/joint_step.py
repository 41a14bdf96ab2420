"""The joint optimizer step (DESIGN s2, decisions 4 and 18): one object owns the accumulation boundary of both
optimizers. DeepSpeed ZeRO-1/2 steps the dense side, the matrix engine the backbone; the trainer, the tests and the
benchmarks all step through `JointOptimizer`, and nobody else writes this sequence.

    begin(step)           method hooks before the first forward (CAST's mask update)
    backward(loss, last)  per micro-batch: + method extra losses, DeepSpeed backward; backbone buckets reduce-scatter
                          while backward still runs (full mode: in the last micro-batch only; sharded mode: in every
                          one, into each rank's own-shard accumulator, engine.grad_accum_mode)
    step()                the boundary, in five phases:
      1 reduce    wait for the backbone reduce-scatter (DeepSpeed reduced its partition in the last backward)
      2 agree     one all-reduce of [dense |g|^2, backbone |g|^2, loss, preemption] and one host read. The
                  squared norms are local sums over each rank's own partition/shards; with clipping off and no
                  norm wanted (not a logging step) they are finiteness flags (0 or inf) instead: no norm work.
                  finite = the joint norm is finite: both sides step, or both skip.
      3 dense     DeepSpeed's step, handed the joint norm: it scales by min(1, clip / (norm + 1e-6)), the one
                  coefficient; its threshold is train.grad_clip before the step and after it (`finally`).
                  A non-finite norm takes DeepSpeed's own skip path: nothing non-finite reaches Adam.
      4 backbone  owners' rule step with the same coefficient; the topology refresh when due; all-gather
      5 hooks     method hooks after the step (ShuffleSparse hardening), metrics

The one host sync per step is phase 2's read: DeepSpeed's ZeRO step branches in Python on its overflow flag and the
engine decides in Python whether its rules run, so finiteness must reach the host every step (on CPU it is free).
The loss and the preemption flag ride along at no extra cost. Refresh steps add the refresh statistics' collectives
(topology_policy.refresh_metrics), logging steps the update rule's statistics (rule_metrics.py: one host read, one
collective; TANS's `tans/{projection}/...`), the branches' output RMS (branch_metrics.py: forward hooks on that
step's micro-batches, one collective) and the share of clipped steps since the last logging step (host counters).
A timed step (the trainer's logging steps) marks the phase boundaries on `timer` (distsparse/step_timer.py: reduce =
phases 1-2, dense_step, then the engine's backbone_step, refresh, gather); an untimed one pays nothing for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distsparse import dist as ddist
from distsparse.optim.engine import MatrixEngine
from distsparse.step_timer import NULL_TIMER, StepTimer
from distsparse.train.branch_metrics import BranchProbe
from distsparse.train.deepspeed.side import DeepSpeedSide
from distsparse.train.method_hooks import HookSet, MethodHooks
from distsparse.train.rule_metrics import rule_metrics
from distsparse.train.topology_policy import TopologyPolicy, refresh_metrics

log = logging.getLogger("distsparse")
SCALARS = ("dense_sq_norm", "backbone_sq_norm", "loss", "preempt")   # the step's one all-reduce, float64


@dataclass
class StepReport:
    """What one joint step did. `metrics` holds its grouped TensorBoard scalars (`loss/`, `optim/`, `topology/`,
    method keys)."""
    applied: bool                   # both sides stepped; False: both skipped (non-finite gradients)
    loss: float                     # model loss, mean over micro-batches and ranks (method extra terms excluded)
    grad_norm: float | None         # joint norm over both sides; None when not measured (clipping off, no log)
    clip_coef: float                # the coefficient both sides applied (1.0: not clipped)
    preempt: bool                   # some rank had a preemption signal when this step's boundary began
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)   # time/{phase} seconds, logging steps only (step_timer)


class JointOptimizer:
    """DeepSpeed's engine (dense side) and the MatrixEngine (backbone) stepped as one optimizer."""

    def __init__(self, ds_engine, matrix: MatrixEngine, *, grad_clip: float, backbone_lr: Callable[[int], float],
                 hooks: MethodHooks | None = None, topology: TopologyPolicy | None = None,
                 timer: StepTimer = NULL_TIMER):
        self.dense = DeepSpeedSide(ds_engine, grad_clip)
        self.matrix, self.grad_clip, self.backbone_lr = matrix, grad_clip, backbone_lr
        self.hooks = hooks if hooks is not None else HookSet([])
        self.topology, self.timer = topology, timer
        self.step_index = 0
        self._losses: list[torch.Tensor] = []
        # The branch's output RMS, measured on logging steps only (branch_metrics.py).
        self.branches = BranchProbe(ds_engine.module)
        # Applied and clipped steps since the last logging step: host ints, since the coefficient is a host float
        # already (phase 2's one read), so `optim/clipped_share` costs no sync and no device op per step.
        self._window_steps = self._window_clipped = 0

    @staticmethod
    def scalar_bytes_per_step(world_size: int) -> float:
        """Bytes a rank sends for the step's scalars: one ring all-reduce of len(SCALARS) float64."""
        return 2 * (world_size - 1) / world_size * len(SCALARS) * torch.float64.itemsize

    # ---- micro-steps -------------------------------------------------------------------------------------

    def begin(self, step: int, *, measure: bool = False) -> None:
        """Start optimizer step `step` (0-based: steps completed so far). `measure` marks a logging step: its
        forwards measure the branches' output RMS (branch_metrics.py), reported by `step(measure_norm=True)`."""
        self.step_index, self._losses = step, []
        if measure:
            self.branches.start()
        self.hooks.before_step(step)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Backward of one micro-batch's model loss; `last` marks the step's final micro-batch."""
        self._losses.append(loss.detach())
        extra = self.hooks.extra_loss(self.step_index)
        if extra is not None:
            loss = loss + extra
        if last:
            self.matrix.start_boundary()   # backbone buckets reduce as their gradients complete
        else:
            self.matrix.start_micro_step()
        self.dense.backward(loss, boundary=last)

    # ---- the boundary ------------------------------------------------------------------------------------

    def step(self, *, measure_norm: bool = False, preempt: bool = False) -> StepReport:
        """Reduce, agree, step both sides with one coefficient (or skip both), refresh, hooks. `measure_norm`
        marks a logging step: it asks for the joint norm when clipping is off and for the update rule's statistics
        (rule_metrics.py, one more collective); `preempt` is this rank's signal flag."""
        assert self._losses, "step() without a backward since begin()"
        # phase 1: reduce
        self.matrix.reduce_gradients()
        # phase 2: agree, one all-reduce and one host read (module docstring)
        norm_wanted = self.grad_clip > 0 or measure_norm
        if norm_wanted:
            dense, backbone = self.dense.local_sq_norm(), self.matrix.local_grad_sq_norm()
        else:
            dense, backbone = self.dense.local_nonfinite(), self.matrix.local_grads_nonfinite()
        device = self.matrix.device
        loss = torch.stack(self._losses).double().mean()
        # The flag by a fill kernel: torch.tensor(x, device=cuda) is a blocking copy that waits for the stream.
        flag = torch.full((), float(preempt), dtype=torch.float64, device=device)
        local = torch.stack([dense.to(device), backbone.to(device), loss.to(device), flag])
        dense_sq, backbone_sq, loss_sum, preempt_count = ddist.dist_sum(local).tolist()   # the host sync
        finite = math.isfinite(dense_sq + backbone_sq)
        norm = math.sqrt(dense_sq + backbone_sq) if norm_wanted and finite else None
        coef = min(1.0, self.grad_clip / (norm + 1e-6)) if self.grad_clip > 0 and finite else 1.0
        self.timer.mark("reduce")   # phases 1 and 2: the waits and the step's collective
        # phase 3: dense side (DeepSpeed's own clip with the joint norm, or its skip path)
        self.dense.step(norm if norm is not None else 0.0, skip=not finite)
        self.timer.mark("dense_step")
        # phase 4: backbone, refresh when due
        taken = self.step_index + 1
        metrics: dict[str, float] = {}
        if finite:
            due = self.topology is not None and self.topology.due(taken)
            refresh = self.topology.refresh_fn(taken) if due else None
            stats = self.matrix.step(self.backbone_lr(self.step_index), coef, refresh, stats=measure_norm,
                                     timer=self.timer)
            if refresh is not None:
                metrics.update(refresh_metrics(stats, self.matrix.last_refresh_seconds))
            if measure_norm and self.matrix.group_rule.stat_keys:   # logging steps: the rule's statistics
                metrics.update(rule_metrics(self.matrix.rule_stats(), self.matrix.rule_name))
            self._window_steps += 1
            self._window_clipped += coef < 1.0
        else:
            log.warning("step %d: non-finite gradients (dense side finite: %s, backbone finite: %s): both sides "
                        "skipped", taken, math.isfinite(dense_sq), math.isfinite(backbone_sq))
            metrics["optim/skipped_steps"] = 1.0
        self.matrix.zero_grad()
        # phase 5: method hooks
        metrics.update(self.hooks.after_step(taken))
        self.timer.mark(None)       # statistics, zero_grad and hooks: no phase of their own
        loss_mean = loss_sum / ddist.world_size()
        metrics.update({"loss/train": loss_mean, "optim/clip_coef": coef})
        if measure_norm:
            metrics.update(self._logging_metrics())
        if norm is not None:
            metrics["optim/grad_norm"] = norm
        return StepReport(finite, loss_mean, norm, coef, preempt_count > 0, metrics)

    def _logging_metrics(self) -> dict[str, float]:
        """A logging step's window statistics: the share of clipped steps among the optimizer steps applied since
        the previous logging step (this one included; skipped steps are not optimizer steps) when clipping is on,
        and the branches' output RMS ratios of this step's forwards (a collective)."""
        out = self.branches.read()
        if self.grad_clip > 0 and self._window_steps:
            out["optim/clipped_share"] = self._window_clipped / self._window_steps
        self._window_steps = self._window_clipped = 0
        return out
