"""The training loop (DESIGN s2): DeepSpeed owns the dense side, the matrix engine owns the backbone, and one
`JointOptimizer` (joint_step.py) steps them together.

One optimizer step:
    micro-steps: forward -> joint.backward (method extra losses; backbone grads -> fp32 buckets via hooks)
    boundary:    joint.step(): reduce-scatter, one all-reduce of the step's scalars, one clip coefficient for
                 DeepSpeed and the backbone (or both skip), topology refresh, all-gather, method hooks
    then:        log, evaluate, checkpoint, stop (preemption agreed in the step's all-reduce)
Methods plug in through distsparse/train/method_hooks.py; this file holds no method names.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from distsparse import dist as ddist
from distsparse.checkpoint import CheckpointManager, LoadedCheckpoint
from distsparse.checkpoint.parts import BackbonePart, RegistryPart, RngPart
from distsparse.config import Config, config_to_dict
from distsparse.data import GlobalBatchSampler, TokenDataset, collate, load_meta, validation_batches
from distsparse.eval.loss import loss_sums, perplexity
from distsparse.layers.projection import SparseProjection
from distsparse.models import backbone_modules, backbone_param, build_model, parameter_counts
from distsparse.models.causal_attention import use_causal_sdpa
from distsparse.optim.engine import MatrixEngine
from distsparse.perf.flops import device_peak_flops, model_step_flops
from distsparse.step_timer import StepTimer
from distsparse.train.batch import BatchPlan, resume_plan
from distsparse.train.deepspeed.checkpoint import DeepSpeedPart
from distsparse.train.deepspeed.config import resolve_dtype
from distsparse.train.joint_step import JointOptimizer, StepReport
from distsparse.train.method_hooks import build_method_hooks
from distsparse.train.metrics import build_writer, peak_memory_gb
from distsparse.train.preemption import PreemptionFlag
from distsparse.train.progress import WINDOW_STEPS, StepWindow, progress_metrics
from distsparse.train.run_state import DataPart, RunPart
from distsparse.train.schedule import lr_factor
from distsparse.train.step_inputs import StepInputs
from distsparse.train.topology_policy import TopologyPolicy

log = logging.getLogger("distsparse")
# Metric groups of every step; a step with any other group (validation, method statistics) is logged when seen.
EVERY_STEP = ("loss", "lr", "optim", "time", "memory", "progress", "perf")


@dataclass
class TrainResult:
    step: int
    train_loss: float
    val_loss: float
    val_ppl: float
    preempted: bool = False


def branch_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of the residual branches' parameters (CoMoLoRA, LoRA, ...): those under a SparseProjection's `branch`."""
    return [f"{name}.branch.{pname}" for name, m in model.named_modules()
            if isinstance(m, SparseProjection) and m.branch is not None
            for pname, p in m.branch.named_parameters() if p.requires_grad]


def dense_side_parameters(model: torch.nn.Module, backbone: dict[str, torch.nn.Module], *,
                          branch_lr: float | None = None, branch_weight_decay: float | None = None) -> list[dict]:
    """Parameter groups handed to DeepSpeed: everything but the backbone matrices (DESIGN decision 1). With a
    branch rate or decay of their own (method.branch_lr, method.branch_weight_decay) the branch parameters form a
    second group carrying them; DeepSpeed's AdamW reads `lr` and `weight_decay` per group, and the LambdaLR
    scheduler scales each group's own initial lr by the one schedule factor."""
    excluded = {id(backbone_param(m)) for m in backbone.values()}
    params = [p for p in model.parameters() if id(p) not in excluded and p.requires_grad]
    if branch_lr is None and branch_weight_decay is None:
        return [{"params": params}]
    named = dict(model.named_parameters())
    branch = {id(named[n]) for n in branch_parameter_names(model)}
    assert branch, "a branch rate or decay without branch parameters (MethodConfig refuses it)"
    group = {"params": [p for p in params if id(p) in branch], "name": "branch"}
    if branch_lr is not None:
        group["lr"] = branch_lr
    if branch_weight_decay is not None:
        group["weight_decay"] = branch_weight_decay
    return [{"params": [p for p in params if id(p) not in branch], "name": "dense"}, group]


def build_matrix_engine(cfg: Config, backbone: dict[str, torch.nn.Module], group, *,
                        initial: dict[str, torch.Tensor], device: torch.device,
                        micro_batches: int | None = None) -> MatrixEngine:
    """The backbone's engine on `device` (where DeepSpeed put the model), its fp32 masters from `initial`.
    `micro_batches`: per optimizer step, the run's BatchPlan.grad_accum (None: train.grad_accum, for tools that
    build an engine without a run)."""
    return MatrixEngine(backbone, rule=cfg.method.rule, hparams=cfg.method.rule_params, mode=cfg.engine.mode,
                        reduce_dtype=cfg.engine.reduce_dtype, group=group, reset_mode=cfg.method.reset_mode,
                        initial_values=initial, grad_accum_mode=cfg.engine.grad_accum_mode,
                        micro_batches=micro_batches or cfg.train.grad_accum, num_buckets=cfg.engine.num_buckets,
                        bucket_bytes=cfg.engine.bucket_bytes, device=device,
                        force_collectives=cfg.engine.force_collectives, compile=cfg.optim.compile)


def deepspeed_device_args() -> SimpleNamespace | None:
    """DeepSpeed places the model on CUDA device LOCAL_RANK unless told otherwise, an invalid ordinal where a cluster
    binds one GPU per task: hand it the device the launcher selected (distsparse.cli.launch_env)."""
    return SimpleNamespace(device_rank=torch.cuda.current_device()) if torch.cuda.is_available() else None


class Trainer:
    """One run: the model, DeepSpeed's engine (dense side), the matrix engine (backbone), their joint step, data,
    policies and checkpoints. The launcher has initialized the process group and selected this process's CUDA
    device."""

    def __init__(self, cfg: Config, ds_config: dict):
        import deepspeed

        self.cfg = cfg
        self.rank, self.world_size = ddist.rank(), ddist.world_size()
        self.meta = load_meta(cfg.data.dir)
        vocab = cfg.model.vocab_size or self.meta["vocab_size"]
        self.model = build_model(cfg.model, cfg.method, vocab, cfg.train.seed)
        use_causal_sdpa(self.model)   # no host sync in transformers' mask preparation (models/causal_attention.py)
        self.backbone = backbone_modules(self.model)
        # Masters come from the fp32 model before DeepSpeed casts it (research/distributed_ns.md s4.6); the engine
        # is built after DeepSpeed has moved the model, on the same device (DESIGN decision 17).
        initial = {name: backbone_param(m).detach().float().clone() for name, m in self.backbone.items()}
        self.checkpoints = CheckpointManager(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints",
                                             cfg.checkpoint.keep_last)
        # The checkpoint comes first: its global batch can decide the accumulation DeepSpeed is built with.
        ckpt = self.checkpoints.find(cfg.checkpoint.resume) if cfg.checkpoint.resume else None
        self.plan: BatchPlan = resume_plan(cfg.train, self.world_size, ckpt.manifest if ckpt else None)
        ds_config = {**ds_config, "gradient_accumulation_steps": self.plan.grad_accum,
                     "train_batch_size": self.plan.global_batch}
        self.engine, _, _, _ = deepspeed.initialize(
            args=deepspeed_device_args(), model=self.model,
            model_parameters=dense_side_parameters(self.model, self.backbone, branch_lr=cfg.method.branch_lr,
                                                   branch_weight_decay=cfg.method.branch_weight_decay),
            config=ds_config, lr_scheduler=self._dense_scheduler)
        self.device = self.engine.device
        self.matrix = build_matrix_engine(cfg, self.backbone, ddist.new_group(), initial=initial, device=self.device,
                                          micro_batches=self.plan.grad_accum)
        del initial
        if self.matrix.shadows:
            shadow_gb = sum(t.untyped_storage().nbytes() for s in self.matrix.shadows.values() for t in s.values())
            log.warning("method.reset_mode none (an ablation setting): dense fp32 shadows of the optimizer state "
                        "hold %.3f GiB on rank %d", shadow_gb / 2**30, self.rank)
        self.dtype = resolve_dtype(cfg)
        self.train_data = TokenDataset(cfg.data.dir, "train", cfg.data.seq_len)
        self.val_data = TokenDataset(cfg.data.dir, "val", cfg.data.seq_len)
        self.sampler = GlobalBatchSampler(len(self.train_data), cfg.train.micro_batch, self.plan.grad_accum,
                                          self.world_size, self.rank, cfg.train.seed)
        self.inputs = StepInputs(self.train_data, self.sampler, self.device)
        self.timer = StepTimer(self.device)
        self.topology = TopologyPolicy(cfg.method.topology, cfg.train.steps, cfg.train.seed)
        self.hooks = build_method_hooks(self.model, self.backbone, cfg.method, micro_batches=self.plan.grad_accum,
                                        total_steps=cfg.train.steps)
        self.joint = JointOptimizer(self.engine, self.matrix, grad_clip=cfg.train.grad_clip, hooks=self.hooks,
                                    topology=self.topology, backbone_lr=lambda s: cfg.method.lr * self.lr_scale(s),
                                    timer=self.timer)
        self.step = 0
        self.report: StepReport | None = None
        self.preemption = PreemptionFlag().install()
        # Saved and loaded in this order: the run's checks before any state, the generators last.
        self.checkpoints.register(run=RunPart(self), data=DataPart(self.inputs),
                                  dense=DeepSpeedPart(self.joint.dense,
                                                      separate_branch_group=cfg.method.separate_branch_group),
                                  backbone=BackbonePart(self.matrix), registry=RegistryPart(self.hooks.saved_state),
                                  rng=RngPart())
        if cfg.checkpoint.resume:
            self.resume(ckpt, cfg.checkpoint.resume)
        self.writer = build_writer(cfg, self.rank, resumed=self.step > 0)

    def _dense_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: self.lr_scale(s))

    def lr_scale(self, step: int | None = None) -> float:
        """The schedule's factor at optimizer step `step` (default: the current one), both sides."""
        t = self.cfg.train
        return lr_factor(self.step if step is None else step, warmup_steps=t.warmup_steps, total_steps=t.steps,
                         min_ratio=t.min_lr_ratio)

    # ---- one optimizer step ------------------------------------------------------------------------------

    def is_logging_step(self, taken: int) -> bool:
        """Optimizer step `taken` (1-based) logs: the norm, the rule's statistics and the phase times."""
        return taken % self.cfg.train.log_interval == 0 or taken == self.cfg.train.steps

    def seek(self, step: int) -> None:
        """Take the next optimizer step as step `step` + 1 of the schedules (lr, topology refresh, penalties) without
        training the steps between: benchmarks time one step at a chosen point of a run (bench/train.py: a refresh
        step at T_end / 2). Model, optimizer state and data order stay as they are."""
        if not 0 <= step < self.cfg.train.steps:
            raise ValueError(f"step: got {step}; allowed: 0 .. {self.cfg.train.steps - 1} (train.steps - 1)")
        self.step = step

    def step_once(self, timed: bool | None = None) -> StepReport:
        """One full optimizer step: this step's inputs (prefetched), `train_step`, the next step's inputs started;
        advances `self.step`. The report carries the phase times (`timings`, step_timer.py) on logging steps, or
        as `timed` says (benchmarks: times without the logging step's statistics)."""
        self.timer.start(self.is_logging_step(self.step + 1) if timed is None else timed)
        batches = self.inputs.next()
        self.timer.mark("data")
        self.train_step(batches)
        self.step += 1
        # The host collates the next step while the device still runs this one's queued updates and gathers; not
        # after the last step, nor after a preempting one (its grace time goes to the save).
        if self.step < self.cfg.train.steps and not self.report.preempt:
            self.inputs.prefetch()
        self.timer.mark("data")
        self.report.timings = self.timer.read()
        return self.report

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors that stay on the host on every device, whose scalar reads wait for no device (OpCounter's
        `host_tensors`): the norm handed to DeepSpeed and torch Adam's step counters (capturable off)."""
        return self.joint.dense.host_tensors()

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One optimizer step over the micro-batches; returns its metrics (the report is kept in `self.report`).
        No host sync but the joint step's one read (joint_step.py): the batches are already on the device when
        they come from `self.inputs`, otherwise moved here."""
        self.joint.begin(self.step, measure=self.is_logging_step(self.step + 1))
        for i, batch in enumerate(batches):
            out = self.engine(input_ids=batch["input_ids"].to(self.device, non_blocking=True),
                              labels=batch["labels"].to(self.device, non_blocking=True))
            self.timer.mark("forward")
            self.joint.backward(out.loss, last=i == len(batches) - 1)
            self.timer.mark("backward")
        self.report = self.joint.step(measure_norm=self.is_logging_step(self.step + 1), preempt=self.preemption.set)
        self.report.metrics.update({"lr/dense": self.cfg.train.lr * self.lr_scale(),
                                    "lr/backbone": self.cfg.method.lr * self.lr_scale()})
        return self.report.metrics

    # ---- evaluation --------------------------------------------------------------------------------------

    def evaluate(self) -> tuple[float, float]:
        self.engine.eval()
        limit = self.cfg.train.eval_samples or None
        index_batches = validation_batches(len(self.val_data), self.cfg.train.micro_batch, self.world_size,
                                           self.rank, limit)
        total, count = loss_sums(self.engine, (collate(self.val_data, idx) for idx in index_batches), self.device)
        self.engine.train()
        total_all = float(ddist.dist_sum(total))
        count_all = int(ddist.dist_sum(float(count)))
        return perplexity(total_all, count_all)

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Collective: a checkpoint of every registered part (__init__) at this step."""
        path = self.checkpoints.save(self.step)
        log.info("saved checkpoint %s", path)
        return path

    def resume(self, ckpt: LoadedCheckpoint | str | None, which: str = "") -> None:
        """Collective: load `ckpt` (found by the caller, or a `checkpoint.resume` value to find; None: none found
        for `which`), part by part as it was saved. Its batch plan must be the one this trainer was built with."""
        if isinstance(ckpt, str):
            ckpt, which = self.checkpoints.find(ckpt), ckpt
        if ckpt is None:
            log.info("resume %s: no checkpoint under %s, starting fresh", which, self.checkpoints.root)
            return
        self.checkpoints.load(ckpt)
        log.info("resumed from %s at step %d (saved on %d ranks, now %d)", ckpt.path, self.step,
                 ckpt.manifest["world_size"], self.world_size)

    # ---- the loop ----------------------------------------------------------------------------------------

    def train(self, on_step: Callable[[int, StepReport], None] | None = None) -> TrainResult:
        """Train to `train.steps`: steps, evaluation, logging, checkpoints, preemption. `on_step(step, report)` runs
        after every optimizer step (a caller that records the run, e.g. tools/gpu_train_check.py)."""
        cfg = self.cfg
        out_dir = Path(cfg.train.out_dir)
        counts = parameter_counts(self.model)
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            log.info("parameters: %s", counts)
        tokens_per_step = self.plan.global_batch * cfg.data.seq_len
        flops = model_step_flops(self.model, cfg.data.seq_len, tokens_per_step)
        peak_flops, peak_note = device_peak_flops(self.device)
        if self.rank == 0:
            log.info("MFU: %s", peak_note)
        window = StepWindow(WINDOW_STEPS, time.perf_counter())   # this process's steps only (a resume starts anew)
        metrics, val_loss, val_ppl = {}, float("nan"), float("nan")
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            report = self.step_once()
            step_time = time.perf_counter() - t0
            if on_step is not None:
                on_step(self.step, report)
            window.add(step_time, tokens_per_step, time.perf_counter())
            metrics = {**report.metrics, **report.timings, "time/step_s": step_time, "memory/peak_gb": peak_memory_gb(),
                       **progress_metrics(window, tokens_seen=self.inputs.consumed_samples * cfg.data.seq_len,
                                          remaining_steps=cfg.train.steps - self.step, flops=flops,
                                          peak_flops=peak_flops, world_size=self.world_size)}
            method_metrics = {}
            if self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps:
                val_loss, val_ppl = self.evaluate()
                method_metrics = self.hooks.metrics()
                metrics.update({"loss/val": val_loss, "loss/val_ppl": val_ppl, **method_metrics})
            periodic = "loss/val" in metrics or any(k.split("/", 1)[0] not in EVERY_STEP for k in metrics)
            if self.step % cfg.train.log_interval == 0 or self.step == cfg.train.steps or periodic:
                self.writer.log(metrics, self.step)
                if self.rank == 0:
                    log.info(self._log_line(metrics, method_metrics))
            if self.report.preempt:   # agreed in the step's all-reduce: every rank saves and stops here
                log.warning("preemption signal: saving a checkpoint at step %d and exiting", self.step)
                self.save()
                return TrainResult(self.step, metrics["loss/train"], val_loss, val_ppl, True)
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0 and self.step < cfg.train.steps:
                self.save()
        if cfg.checkpoint.save_at_end and (cfg.checkpoint.interval or cfg.checkpoint.resume):
            self.save()
        train_loss = metrics.get("loss/train", float("nan"))   # nan: resumed at train.steps, no step taken here
        final = {"final/val_loss": val_loss, "final/val_ppl": val_ppl, "final/train_loss": train_loss}
        # The realized parameter counts sit next to the hyperparameters (branch share included).
        self.writer.hparams({**config_to_dict(cfg), "parameter_counts": counts}, final)
        if self.rank == 0:
            (out_dir / "result.json").write_text(json.dumps({"step": self.step, **final}, indent=2))
        return TrainResult(self.step, train_loss, val_loss, val_ppl)

    def _log_line(self, metrics: dict[str, float], method_metrics: dict[str, float]) -> str:
        """Rank 0's console line: step, loss, grad_norm (when measured), lr, tokens/s (window), tokens seen, MFU
        (with a known peak), ETA, validation, method."""
        line = f"step {self.step}/{self.cfg.train.steps} | loss {metrics['loss/train']:.4f}"
        if "optim/grad_norm" in metrics:
            line += f" | grad_norm {metrics['optim/grad_norm']:.3f}"
        line += (f" | lr {metrics['lr/dense']:.2e} | tok/s {metrics['time/tokens_per_s']:.0f} | "
                 f"tokens {metrics['progress/tokens_seen']:.4g}")
        if "perf/mfu_dense_equiv" in metrics:
            line += (f" | mfu_dense_equiv {100 * metrics['perf/mfu_dense_equiv']:.1f}%"
                     f" | mfu_active {100 * metrics['perf/mfu_active']:.1f}%")
        line += f" | eta {metrics['progress/eta_s']:.0f}s"
        if "loss/val" in metrics:
            line += f" | val_loss {metrics['loss/val']:.4f} | val_ppl {metrics['loss/val_ppl']:.2f}"
        return line + "".join(f" | {key.rsplit('/', 1)[-1]} {value:.3f}" for key, value in method_metrics.items())

    def close(self) -> None:
        self.preemption.uninstall()
        self.writer.close()
