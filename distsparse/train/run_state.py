"""The trainer's own parts of a run checkpoint (checkpoint/parts.py), registered first so that they load first.

    RunPart    the run: its config, batch plan and what the data and model shapes derive from (manifest only).
               Loading it refuses a checkpoint of another model or method by name and one of another batch plan,
               logs what changed since the checkpoint, and sets the trainer's step: before any state is read.
    DataPart   the data position: the samples the optimizer steps have consumed (a prefetched step is not).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distsparse.checkpoint import CheckpointError, LoadedCheckpoint, Part, resume_changes
from distsparse.config import config_to_dict
from distsparse.train.batch import describe_resume, resume_plan, saved_batch
from distsparse.train.step_inputs import StepInputs

if TYPE_CHECKING:
    from distsparse.train.trainer import Trainer

log = logging.getLogger("distsparse")


class RunPart(Part):
    """The run's settings in the manifest; on load the checks before any state (module docstring)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def manifest(self) -> dict:
        t = self.trainer
        return {"config": config_to_dict(t.cfg), "tokenizer_sha256": t.meta.get("tokenizer_sha256", ""),
                "ns_coefficients": getattr(t.matrix.hp, "ns_coefficients", None), "ffn_width": t.cfg.model.ffn_width,
                "dtype": t.dtype, "vocab_size": t.model.config.vocab_size,
                "global_batch_size": t.plan.global_batch, "grad_accum": t.plan.grad_accum}

    def load(self, ckpt: LoadedCheckpoint) -> None:
        """Refuse or log (module docstring); the batch plan must be the one the trainer was built with
        (DeepSpeed's accumulation is fixed at initialize: Trainer.__init__ reads the checkpoint's first)."""
        t, m = self.trainer, ckpt.manifest
        changes = resume_changes(m, ckpt.path, t.cfg, t.meta)   # refuses another model or method by name
        if changes:
            log.info("resume from %s: changed since the checkpoint (allowed): %s", ckpt.path, "; ".join(changes))
        needed = resume_plan(t.cfg.train, t.world_size, m)
        if needed != t.plan:
            raise CheckpointError(f"checkpoint {ckpt.path} needs the batch plan {needed}, this trainer was built "
                                  f"with {t.plan}; allowed: a Trainer built with checkpoint.resume set to it")
        batch_change = describe_resume(t.plan, saved_batch(m))
        if batch_change:
            log.info("resume from %s: %s", ckpt.path, batch_change)
        t.step = m["step"]


class DataPart(Part):
    """The data position: the sampler's `consumed_samples` as the optimizer steps have consumed them."""

    def __init__(self, inputs: StepInputs):
        self.inputs = inputs

    def manifest(self) -> dict:
        return {"consumed_samples": self.inputs.consumed_samples}

    def load(self, ckpt: LoadedCheckpoint) -> None:
        self.inputs.sampler.load_state_dict({"consumed_samples": ckpt.manifest["consumed_samples"]})
