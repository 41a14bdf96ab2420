"""The training loop (DESIGN s2): DeepSpeed owns the dense side, the matrix engine owns the backbone.

One optimizer step:
    micro-steps: forward -> engine.backward (backbone grads -> fp32 buffer via hooks)
    boundary:    reduce-scatter backbone grads; joint clip over both sides; DeepSpeed step;
                 backbone step (skipped with a skipped DeepSpeed step or non-finite grads), topology refresh,
                 all-gather of codes and values
    then:        log, evaluate, stop
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from distsparse import dist as ddist
from distsparse.checkpoint import CheckpointManager, resume_changes
from distsparse.config import Config, config_to_dict
from distsparse.data import GlobalBatchSampler, TokenDataset, collate, load_meta, validation_batches
from distsparse.eval.loss import loss_sums, perplexity
from distsparse.layers.branches import mean_aux_loss
from distsparse.layers.dense_latent import DenseLatentLinear, cast_metrics
from distsparse.models import backbone_modules, backbone_param, build_model, parameter_counts
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.rules import get_rule
from distsparse.train.dense_state import gather_dense_state, restore_dense_state
from distsparse.train.ds_config import resolve_dtype
from distsparse.train.permutation_policy import PermutationPolicy
from distsparse.train.preemption import PreemptionFlag
from distsparse.train.metrics import NullWriter, TensorBoardWriter, peak_memory_gb
from distsparse.train.schedule import lr_factor
from distsparse.train.topology_policy import TopologyPolicy, refresh_metrics

log = logging.getLogger("distsparse")


@dataclass
class TrainResult:
    step: int
    train_loss: float
    val_loss: float
    val_ppl: float
    preempted: bool = False


def dense_side_parameters(model: torch.nn.Module, backbone: dict[str, torch.nn.Module]) -> list[dict]:
    """Parameter groups handed to DeepSpeed: everything but the backbone matrices (DESIGN decision 1)."""
    excluded = {id(backbone_param(m)) for m in backbone.values()}
    params = [p for p in model.parameters() if id(p) not in excluded and p.requires_grad]
    return [{"params": params}]


def build_matrix_engine(cfg: Config, backbone: dict[str, torch.nn.Module], group, *,
                        initial: dict[str, torch.Tensor], device: torch.device) -> MatrixEngine:
    """The backbone's engine on `device` (where DeepSpeed put the model), its fp32 masters from `initial`."""
    rule = get_rule(cfg.method.rule)
    try:
        hparams = rule.hparams(lr=cfg.method.lr, **cfg.method.rule_args)
    except TypeError as err:
        raise ValueError(f"method.rule_args: {err}; allowed keys for rule {cfg.method.rule!r}: "
                         f"{', '.join(f for f in rule.hparams.__dataclass_fields__ if f != 'lr')}") from None
    return MatrixEngine(backbone, rule=cfg.method.rule, hparams=hparams, mode=cfg.engine.mode,
                        reduce_dtype=cfg.engine.reduce_dtype, group=group, initial_values=initial,
                        num_buckets=cfg.engine.num_buckets, device=device,
                        force_collectives=cfg.engine.force_collectives)


def deepspeed_device_args() -> SimpleNamespace | None:
    """DeepSpeed places the model on CUDA device LOCAL_RANK unless told otherwise, an invalid ordinal where a cluster
    binds one GPU per task: hand it the device the launcher selected (distsparse.launch_env)."""
    return SimpleNamespace(device_rank=torch.cuda.current_device()) if torch.cuda.is_available() else None


class Trainer:
    """One run: the model, DeepSpeed's engine (dense side), the matrix engine (backbone), data, policies and
    checkpoints. The launcher has initialized the process group and selected this process's CUDA device."""

    def __init__(self, cfg: Config, ds_config: dict):
        import deepspeed

        self.cfg = cfg
        self.rank, self.world_size = ddist.rank(), ddist.world_size()
        self.meta = load_meta(cfg.data.dir)
        vocab = cfg.model.vocab_size or self.meta["vocab_size"]
        self.model = build_model(cfg.model, cfg.method, vocab, cfg.train.seed)
        self.backbone = backbone_modules(self.model)
        for module in self.backbone.values():
            if isinstance(module, DenseLatentLinear):
                # SR-STE adds lambda_w * W in every backward, unscaled by DeepSpeed's 1/grad_accum.
                module.lambda_w /= cfg.train.grad_accum
        # Masters come from the fp32 model before DeepSpeed casts it (research/distributed_ns.md s4.6); the engine
        # is built after DeepSpeed has moved the model, on the same device (DESIGN decision 17).
        initial = {name: backbone_param(m).detach().float().clone() for name, m in self.backbone.items()}
        self.engine, _, _, _ = deepspeed.initialize(
            args=deepspeed_device_args(), model=self.model,
            model_parameters=dense_side_parameters(self.model, self.backbone),
            config=ds_config, lr_scheduler=self._dense_scheduler)
        self.device = self.engine.device
        self.matrix = build_matrix_engine(cfg, self.backbone, ddist.new_group(), initial=initial, device=self.device)
        del initial
        self.dtype = resolve_dtype(cfg)
        self.train_data = TokenDataset(cfg.data.dir, "train", cfg.data.seq_len)
        self.val_data = TokenDataset(cfg.data.dir, "val", cfg.data.seq_len)
        self.sampler = GlobalBatchSampler(len(self.train_data), cfg.train.micro_batch, cfg.train.grad_accum,
                                          self.world_size, self.rank, cfg.train.seed)
        self.topology = TopologyPolicy(cfg.method.topology, cfg.train.steps, cfg.train.seed)
        self.permutations = PermutationPolicy(cfg.method.permutation, self.model, cfg.train.steps)
        self.writer = TensorBoardWriter(str(Path(cfg.train.out_dir) / "tb")) if self.rank == 0 else NullWriter()
        self.step = 0
        self.checkpoints = CheckpointManager(cfg.checkpoint.dir or Path(cfg.train.out_dir) / "checkpoints",
                                             cfg.checkpoint.keep_last)
        self.preemption = PreemptionFlag().install()
        if cfg.checkpoint.resume:
            self.resume(cfg.checkpoint.resume)

    def _dense_scheduler(self, optimizer):
        t = self.cfg.train
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
            s, warmup_steps=t.warmup_steps, total_steps=t.steps, min_ratio=t.min_lr_ratio))

    def lr_scale(self) -> float:
        t = self.cfg.train
        return lr_factor(self.step, warmup_steps=t.warmup_steps, total_steps=t.steps, min_ratio=t.min_lr_ratio)

    # ---- one optimizer step ------------------------------------------------------------------------------

    def _clip(self) -> tuple[float, float]:
        """Joint clip over DeepSpeed and the backbone (DESIGN decision 4): returns (total norm, coefficient)
        and sets DeepSpeed's clip threshold so that it applies the same coefficient."""
        ds_norm = float(self.engine.optimizer.scaled_global_norm())
        total = math.sqrt(ds_norm ** 2 + float(self.matrix.grad_sq_norm()))
        max_norm = self.cfg.train.grad_clip
        if max_norm <= 0 or total <= max_norm:
            return total, 1.0
        self.engine.optimizer.clip_grad = max_norm * ds_norm / total
        return total, max_norm / (total + 1e-6)

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        for module in self.backbone.values():
            if isinstance(module, DenseLatentLinear) and module.mode == "cast":
                module.maybe_update_mask(self.step)   # CAST recomputes its mask every few steps
        losses = []
        grad_norm, coef = 0.0, 1.0
        for i, batch in enumerate(batches):
            if i == len(batches) - 1:
                self.matrix.start_boundary()   # backbone buckets reduce as their gradients complete
            else:
                self.matrix.start_micro_step()
            out = self.engine(input_ids=batch["input_ids"].to(self.device), labels=batch["labels"].to(self.device))
            loss = out.loss
            for extra in (mean_aux_loss(self.model),               # Add+Align's alignment term
                          self.permutations.penalty(self.step)):   # ShuffleSparse penalty on soft blocks
                if extra is not None:
                    loss = loss + extra
            self.engine.backward(loss)
            losses.append(out.loss.detach().float())
            if i == len(batches) - 1:
                self.matrix.reduce_gradients()
                grad_norm, coef = self._clip()
            saved_clip = self.engine.optimizer.clip_grad
            self.engine.step()
            self.engine.optimizer.clip_grad = saved_clip   # it is serialized with checkpoints
        applied = self.engine.was_step_applied()
        finite = self.matrix.grads_finite()
        metrics = {"optim/grad_norm": grad_norm, "optim/clip_coef": coef,
                   "lr/dense": self.cfg.train.lr * self.lr_scale(),
                   "lr/backbone": self.cfg.method.lr * self.lr_scale()}
        if applied and finite:
            taken = self.step + 1
            refresh = self.topology.refresh_fn(taken) if self.topology.due(taken) else None
            stats = self.matrix.step(self.cfg.method.lr * self.lr_scale(), coef, refresh)
            if refresh is not None:
                metrics.update(refresh_metrics(stats, self.matrix.last_refresh_seconds))
        else:
            log.warning("step %d: backbone step skipped (DeepSpeed step applied: %s, backbone grads finite: %s)",
                        self.step, applied, finite)
            metrics["optim/skipped_steps"] = 1.0
        self.matrix.zero_grad()
        metrics.update(self.permutations.after_step(self.step + 1))
        loss = ddist.dist_sum(torch.stack(losses).mean().double()) / self.world_size
        metrics["loss/train"] = float(loss)
        return metrics

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
        manifest = {"consumed_samples": self.sampler.state_dict()["consumed_samples"],
                    "config": config_to_dict(self.cfg), "tokenizer_sha256": self.meta.get("tokenizer_sha256", ""),
                    "ns_coefficients": getattr(self.matrix.hp, "ns_coefficients", None),
                    "ffn_width": self.cfg.model.ffn_width, "dtype": self.dtype,
                    "vocab_size": self.model.config.vocab_size}
        # Permutation state (theta, hardening) also lives in DeepSpeed's module file; the registry copy lets
        # export and consolidation read it from project files alone.
        registry = {name: perm for name, perm in self.permutations.perms}
        path = self.checkpoints.save(self.step, ds_engine=self.engine, matrix_engine=self.matrix, manifest=manifest,
                                     dense_state=gather_dense_state(self.engine, self.model, self.rank),
                                     registry=registry)
        log.info("saved checkpoint %s", path)
        return path

    def resume(self, which: str) -> None:
        ckpt = self.checkpoints.find(which)
        if ckpt is None:
            log.info("resume %s: no checkpoint under %s, starting fresh", which, self.checkpoints.root)
            return
        m = ckpt.manifest
        changes = resume_changes(m, ckpt.path, self.cfg, self.meta)   # refuses another model or method by name
        if changes:
            log.info("resume from %s: changed since the checkpoint (allowed): %s", ckpt.path, "; ".join(changes))
        if m["world_size"] == self.world_size:
            self.engine.load_checkpoint(str(ckpt.path.parent), tag=ckpt.path.name)
        else:
            # ZeRO files are per partition: load the module, then the dense optimizer state by name.
            self.engine.load_checkpoint(str(ckpt.path.parent), tag=ckpt.path.name, load_module_only=True,
                                        load_optimizer_states=False, load_lr_scheduler_states=False)
            restore_dense_state(self.engine, self.model, self.checkpoints.load_tensors(ckpt, "dense_state.safetensors"),
                                m["step"])
        self.matrix.load_state_dict(self.checkpoints.load_backbone(ckpt, list(self.matrix.masters)))
        self.sampler.load_state_dict({"consumed_samples": m["consumed_samples"]})
        self.step = m["step"]
        self.checkpoints.load_rng(ckpt)
        log.info("resumed from %s at step %d (saved on %d ranks, now %d)", ckpt.path, self.step, m["world_size"],
                 self.world_size)

    # ---- the loop ----------------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        cfg = self.cfg
        out_dir = Path(cfg.train.out_dir)
        if self.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
            log.info("parameters: %s", parameter_counts(self.model))
        tokens_per_step = cfg.train.micro_batch * cfg.train.grad_accum * self.world_size * cfg.data.seq_len
        micro_batches = iter(self.sampler)
        start = time.perf_counter()
        metrics, val_loss, val_ppl = {}, float("nan"), float("nan")
        preempted = False
        while self.step < cfg.train.steps:
            t0 = time.perf_counter()
            batches = [collate(self.train_data, next(micro_batches)) for _ in range(cfg.train.grad_accum)]
            metrics = self.train_step(batches)
            self.step += 1
            step_time = time.perf_counter() - t0
            metrics.update({"time/step_s": step_time, "time/tokens_per_s": tokens_per_step / step_time,
                            "memory/peak_gb": peak_memory_gb()})
            if self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps:
                val_loss, val_ppl = self.evaluate()
                metrics.update({"loss/val": val_loss, "loss/val_ppl": val_ppl})
                metrics.update(cast_metrics(self.backbone.values()))   # how much CAST's projection will cut
            periodic = any(k.startswith(("loss/val", "topology/", "permutation/")) for k in metrics)
            if self.step % cfg.train.log_interval == 0 or self.step == cfg.train.steps or periodic:
                self.writer.log(metrics, self.step)
                if self.rank == 0:
                    elapsed = time.perf_counter() - start
                    eta = elapsed / self.step * (cfg.train.steps - self.step)
                    line = (f"step {self.step}/{cfg.train.steps} | loss {metrics['loss/train']:.4f} | "
                            f"grad_norm {metrics['optim/grad_norm']:.3f} | lr {metrics['lr/dense']:.2e} | "
                            f"tok/s {metrics['time/tokens_per_s']:.0f} | eta {eta:.0f}s")
                    if "loss/val" in metrics:
                        line += f" | val_loss {val_loss:.4f} | val_ppl {val_ppl:.2f}"
                    if "cast/projection_cut" in metrics:
                        line += f" | projection_cut {metrics['cast/projection_cut']:.3f}"
                    log.info(line)
            if ddist.any_rank(self.preemption.set):   # one collective: ranks agree on a signal seen by any
                log.warning("preemption signal: saving a checkpoint at step %d and exiting", self.step)
                self.save()
                preempted = True
                break
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0 and self.step < cfg.train.steps:
                self.save()
        if preempted:
            return TrainResult(self.step, metrics.get("loss/train", float("nan")), val_loss, val_ppl, True)
        if cfg.checkpoint.save_at_end and (cfg.checkpoint.interval or cfg.checkpoint.resume):
            self.save()
        final = {"final/val_loss": val_loss, "final/val_ppl": val_ppl, "final/train_loss": metrics["loss/train"]}
        self.writer.hparams(config_to_dict(cfg), final)
        if self.rank == 0:
            (out_dir / "result.json").write_text(json.dumps({"step": self.step, **final}, indent=2))
        return TrainResult(self.step, metrics["loss/train"], val_loss, val_ppl)

    def close(self) -> None:
        self.preemption.uninstall()
        self.writer.close()
