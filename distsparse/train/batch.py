"""The global batch (sequences per optimizer step) and the gradient accumulation that follows from it (issue 26).

`train.global_batch_size` is the truth when set: accumulation = global / (train.micro_batch x world size), refused
when it does not divide. `train.global_batch_size: 0` is the legacy form: global = micro_batch x grad_accum x world,
except on a resume that changes neither micro_batch nor grad_accum: then the checkpoint's global batch is kept and
the accumulation follows the world size (an elastic resume, e.g. 2 ranks -> 1 doubles the accumulation). With
global_batch_size set, train.grad_accum left at its default 1 means "derive it"; any other value must agree.

One resolved `BatchPlan` feeds the trainer, the sampler, the method hooks, the matrix engine and DeepSpeed's
gradient_accumulation_steps; validate.py resolves it before any process group starts.
"""

from __future__ import annotations

from dataclasses import dataclass

UNSTATED_GRAD_ACCUM = 1   # TrainConfig.grad_accum's default: with global_batch_size set it means "derive"


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int    # sequences per optimizer step, all ranks
    micro_batch: int     # sequences per rank per micro-step
    grad_accum: int      # micro-steps per optimizer step
    world_size: int


@dataclass(frozen=True)
class SavedBatch:
    """The batch a checkpoint was trained with: its global batch and the user's micro_batch and grad_accum."""
    global_batch: int
    micro_batch: int
    grad_accum: int
    world_size: int


def saved_batch(manifest: dict) -> SavedBatch:
    """From a checkpoint manifest; manifests from before `global_batch_size` was recorded give the product."""
    train = manifest["config"]["train"]
    world = int(manifest["world_size"])
    # before issue 26 the manifest had no global_batch_size and the accumulation used was train.grad_accum
    accum = int(manifest.get("grad_accum", train["grad_accum"]))
    global_batch = int(manifest.get("global_batch_size", train["micro_batch"] * accum * world))
    return SavedBatch(global_batch, int(train["micro_batch"]), int(train["grad_accum"]), world)


def resolve_batch(train, world_size: int, saved: SavedBatch | None = None) -> BatchPlan:
    """The run's BatchPlan from `train` (TrainConfig) on `world_size` ranks, `saved`: the checkpoint resumed from.
    ValueError naming the numbers when the global batch is not micro_batch x world x an integer."""
    micro, stated = train.micro_batch, train.grad_accum
    if train.global_batch_size:
        target = train.global_batch_size
    elif saved is not None and (micro, stated) == (saved.micro_batch, saved.grad_accum):
        target = saved.global_batch
    else:
        return BatchPlan(micro * stated * world_size, micro, stated, world_size)
    per_micro_step = micro * world_size
    if target % per_micro_step:
        source = ("train.global_batch_size: got" if train.global_batch_size else
                  f"checkpoint.resume: the checkpoint's global batch (saved on {saved.world_size} rank(s); "
                  f"train.global_batch_size 0 keeps it) is")
        raise ValueError(f"{source} {target}, not a multiple of train.micro_batch ({micro}) x {world_size} "
                         f"rank(s) = {per_micro_step}; allowed: a global batch divisible by {per_micro_step}, or "
                         f"a train.micro_batch / world size whose product divides {target}")
    accum = target // per_micro_step
    if train.global_batch_size and stated not in (UNSTATED_GRAD_ACCUM, accum):
        raise ValueError(f"train.grad_accum: got {stated}, but train.global_batch_size {target} / (train.micro_batch "
                         f"{micro} x {world_size} rank(s)) gives {accum}; allowed: {accum}, or leave train.grad_accum "
                         f"at 1 (derived), or train.global_batch_size 0 (accumulation from train.grad_accum)")
    return BatchPlan(target, micro, accum, world_size)



def resume_plan(train, world_size: int, manifest: dict | None) -> BatchPlan:
    """The plan of a run on `world_size` ranks resuming from the checkpoint whose manifest this is (None: fresh):
    the one Trainer is built with and RunPart checks a checkpoint against."""
    return resolve_batch(train, world_size, saved_batch(manifest) if manifest else None)

def check_resume_position(plan: BatchPlan, saved: SavedBatch, consumed_samples: int, train) -> None:
    """ValueError, before any process group, when a resume's global batch does not divide the samples the checkpoint
    consumed: the sampler continues at a whole global batch (data/sampler.py) and would refuse it after launch."""
    if consumed_samples % plan.global_batch == 0:
        return
    source = (f"train.global_batch_size: got {plan.global_batch}" if train.global_batch_size else
              f"train.micro_batch: got {plan.micro_batch}, a global batch of train.micro_batch x train.grad_accum "
              f"({train.grad_accum}) x {plan.world_size} rank(s) = {plan.global_batch}")
    raise ValueError(f"{source}, but the checkpoint resumed has consumed {consumed_samples} samples, not a multiple "
                     f"of it; allowed: a global batch that divides {consumed_samples} (the checkpoint's is "
                     f"{saved.global_batch}), or a checkpoint.resume whose consumed samples it divides")


def describe_resume(plan: BatchPlan, saved: SavedBatch) -> str | None:
    """The resume log's sentence on the batch, None when nothing about it changed."""
    if plan.global_batch == saved.global_batch:
        saved_accum = saved.global_batch // (saved.micro_batch * saved.world_size)
        if saved_accum == plan.grad_accum:
            return None
        return (f"accumulation {saved_accum} -> {plan.grad_accum} to keep the global batch {plan.global_batch} "
                f"({saved.world_size} -> {plan.world_size} rank(s))")
    return (f"global batch {saved.global_batch} -> {plan.global_batch} (accumulation {plan.grad_accum} on "
            f"{plan.world_size} rank(s)): the learning-rate schedule's steps now hold another number of sequences")
