"""A comparison protocol as one command (issue 28 item 5): a plan file (distsparse/configs/plans/<name>.yaml or a
path) names the model, the token budget, the methods and the sweeps; `bench_quality --plan` runs it in three
stages, each stage's missing runs as one submitit job array (one task per GPU), and ranks the result with
quality_summary.

    python -m bench.bench_quality --plan paper_60m --data data/c4_60m --root runs/paper_60m \\
        --executor slurm --partition gpu --account proj --time 3:00:00 [--array-parallelism 16]
    python -m bench.bench_quality --plan paper_60m --data data/pydocs4k --root runs/plan_local --executor local \\
        --plan-set model=tiny --plan-set steps=8 ...          # the same plan here, one run at a time

1. seed 0, every method at each `backbone_lr_scales` factor of its preset's method.lr (factor 1: the presets' own
   rates, the paper's fixed-rate protocol), the rest of the model at the preset's train.lr;
2. seed 0, the methods with a branch: each `branch_lr_scales` factor of train.lr as method.branch_lr, at the
   stage-1 best backbone factor;
3. every seed of `seeds` at each method's best seed-0 point.
A stage starts when the one before it has every run finished. Every run is full length, in quality_summary's
layout (`<root>/seed<S>/<method>/sweep_b<b>_d1[_r<r>]`), one process with `train.micro_batch` =
micro_batch_per_gpu and the accumulation that makes global_batch. Finished runs of their config are read back, so
the same command again (after a failure, a cancelled array, a finished stage) continues where the plan stands; an
unfinished run restarts from step 0. `--executor slurm` submits and waits (tmux on the login node); task logs are
under <root>/submitit.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from bench import quality_runs, quality_summary
from bench.quality_runs import RunInTheWay, RunOutcome, RunSpec, finished_earlier, point_name, refuse_to_replace
from distsparse.cli.slurm import parse_time
from distsparse.config import shipped_or_given
from distsparse.strict_config import build_settings, parse_override, read_yaml_file

STAGES = ("backbone sweep", "branch sweep", "seeds")


@dataclasses.dataclass(kw_only=True)
class Plan:
    """A comparison protocol (configs/plans/*.yaml)."""

    model: str
    seq_len: int
    global_batch: int                # sequences per optimizer step
    micro_batch_per_gpu: int
    steps: int
    warmup_steps: int
    eval_points: int
    eval_samples: int
    ds_config: str
    methods: list
    backbone_lr_scales: list
    branch_lr_scales: list
    seeds: list
    overrides: list = dataclasses.field(default_factory=list)   # key=value for every run
    keep_checkpoint: bool = False    # each run's final checkpoint kept (changes no number; --keep-checkpoint)

    def __post_init__(self) -> None:
        for key in ("seq_len", "global_batch", "micro_batch_per_gpu", "steps", "eval_points"):
            if getattr(self, key) < 1:
                raise ValueError(f"plan.{key}: got {getattr(self, key)}; allowed: >= 1")
        if self.global_batch % self.micro_batch_per_gpu:
            raise ValueError(f"plan.global_batch: got {self.global_batch} with micro_batch_per_gpu "
                             f"{self.micro_batch_per_gpu}; allowed: a multiple of micro_batch_per_gpu (one GPU "
                             "per run accumulates global_batch / micro_batch_per_gpu micro-batches)")
        _names("plan.methods", self.methods)
        _names("plan.overrides", self.overrides)
        for key in ("backbone_lr_scales", "branch_lr_scales"):
            scales = getattr(self, key)
            if not quality_runs.valid_scales(scales):
                raise ValueError(f"plan.{key}: got {scales!r}; allowed: a list of distinct positive numbers")
        if 1 not in self.backbone_lr_scales:
            raise ValueError(f"plan.backbone_lr_scales: got {self.backbone_lr_scales!r}; allowed: a list holding "
                             "1 (the presets' own rates: the paper's fixed-rate protocol)")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.seeds) \
                or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"plan.seeds: got {self.seeds!r}; allowed: distinct integers >= 1 (seed 0 runs the "
                             "sweeps)")

    @property
    def grad_accum(self) -> int:
        return self.global_batch // self.micro_batch_per_gpu


def _names(key: str, values: list) -> None:
    if not all(isinstance(v, str) and v for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{key}: got {values!r}; allowed: a list of distinct non-empty strings")


def load_plan(given: str, plan_set: list[str] = ()) -> Plan:
    """The plan file `given` (a path, or a name the package ships in configs/plans/), with `key=value` changes."""
    path = shipped_or_given(given, "plans", ".yaml", "--plan")
    raw = read_yaml_file(path, "--plan") or {}
    for item in plan_set:
        raw.update(parse_override(item))
    return build_settings(Plan, raw, f"plan {path.name}")


def comparison_args(plan: Plan, data: str, root: Path, seed: int, lr_scales: list[float],
                    branch_lr_scales: list[float] = ()) -> argparse.Namespace:
    """bench_quality's settings for one seed of the plan: every method swept at `lr_scales` (x the branch scales)
    on full-length runs, so each point is a run of quality_summary's layout under <root>/seed<seed>."""
    argv = ["--data", data, "--methods", ",".join(plan.methods), "--lr-sweep", ",".join(plan.methods),
            "--model", plan.model, "--steps", str(plan.steps), "--sweep-steps", str(plan.steps),
            "--micro-batch", str(plan.global_batch), "--seq-len", str(plan.seq_len),
            "--eval-points", str(plan.eval_points), "--eval-samples", str(plan.eval_samples),
            "--seed", str(seed), "--warmup-steps", str(plan.warmup_steps), "--ds-config", plan.ds_config,
            "--lr-scales", ",".join(f"{s:g}" for s in lr_scales), "--dense-lr-scales", "1",
            "--out-root", str(root / f"seed{seed}"), "--json", str(root / f"seed{seed}.json")]
    if plan.keep_checkpoint:
        argv.append("--keep-checkpoint")
    if branch_lr_scales:
        argv += ["--branch-lr-scales", ",".join(f"{s:g}" for s in branch_lr_scales)]
    # One process per run: the micro-batch of one GPU and the accumulation that makes the global batch.
    for item in (f"train.micro_batch={plan.micro_batch_per_gpu}", f"train.grad_accum={plan.grad_accum}",
                 *plan.overrides):
        argv += ["--set", item]
    return quality_runs.parse_args(argv)


@dataclasses.dataclass
class PlannedRun:
    args: argparse.Namespace       # bench_quality's settings of the run's seed
    spec: RunSpec
    point: tuple[float, ...]       # (backbone factor, dense-side factor[, branch factor]), as quality_summary reads it


def _planned(args: argparse.Namespace, method: str) -> list[PlannedRun]:
    return [PlannedRun(args, spec, key) for key, spec in quality_runs.sweep_specs(args, method).items()]


def stage_runs(plan: Plan, data: str, root: Path, stage: int, best: dict[str, tuple[float, ...]]) -> list[PlannedRun]:
    """The runs of `stage` (0, 1, 2); `best` holds each method's best seed-0 point of the stages before."""
    if stage == 0:
        args = comparison_args(plan, data, root, 0, plan.backbone_lr_scales)
        return [run for method in plan.methods for run in _planned(args, method)]
    runs = []
    for method in plan.methods:
        b, _, *r = best[method]
        if stage == 1:
            args = comparison_args(plan, data, root, 0, [b], plan.branch_lr_scales)
            if quality_runs.has_branch(method, quality_runs.base_overrides(args)):
                runs += _planned(args, method)
        else:
            runs += [run for seed in plan.seeds for run in _planned(comparison_args(plan, data, root, seed, [b], r),
                                                                     method)]
    return runs


def record_seed0(scores: dict[str, dict[tuple[float, ...], float]], runs: list[PlannedRun],
                 outcomes: list[RunOutcome]) -> dict[str, tuple[float, ...]]:
    """Add the finite final PPLs of seed-0 `runs` to `scores` (method -> point -> PPL) and return every method's
    best point so far (a diverged run is never best)."""
    for run, outcome in zip(runs, outcomes):
        if outcome.final_ppl is not None and math.isfinite(outcome.final_ppl):
            scores.setdefault(run.spec.method, {})[run.point] = outcome.final_ppl
    return {method: min(points, key=points.get) for method, points in scores.items() if points}


def run_stage(runs: list[PlannedRun], executor: Any, parallel: int) -> list[RunOutcome]:
    """Train the runs of a stage that have no result of their config yet, as job arrays of at most `parallel`
    tasks (0: all at once), and read every run's outcome back from its directory."""
    import submitit

    missing = [r for r in runs if not finished_earlier(r.args, r.spec)]
    print(f"  {len(runs) - len(missing)} of {len(runs)} runs finished earlier; {len(missing)} to train", flush=True)
    for r in missing:
        refuse_to_replace(r.args, r.spec)
    chunk = parallel or max(len(missing), 1)
    for start in range(0, len(missing), chunk):
        part = missing[start:start + chunk]
        for r in part:
            if r.spec.out_dir.exists():
                shutil.rmtree(r.spec.out_dir)   # an unfinished attempt's event files would mix into the curve
        with executor.batch():
            jobs = [executor.submit(task_function(quality_runs.run_command(r.args, r.spec), executor)) for r in part]
        print(f"  submitted {len(jobs)} runs (job {jobs[0].job_id.split('_')[0]}); waiting", flush=True)
        for r, job in zip(part, jobs):
            try:
                job.result()
                print(f"  [{r.spec.label}] seed {r.args.seed}: finished", flush=True)
            except Exception as err:   # a failed task: its directory has no result; reported after the stage
                print(f"  [{r.spec.label}] seed {r.args.seed}: failed ({str(err).splitlines()[0][:200]}); log "
                      f"{job.paths.stderr}", flush=True)
    return [quality_runs.read_outcome(r.args, r.spec, 0, [], None) for r in runs]


def task_function(command: list[str], executor: Any) -> Any:
    """The submitted callable of one run. A SLURM task runs it in the environment SLURM gives the task (its
    CUDA_VISIBLE_DEVICES, its one-task SLURM_* that launch_env reads as a world of 1): an environment captured here,
    on the submitting host, would replace it and put every task of a node on its first GPU. A local task runs in
    this process's environment less SLURM_* (an salloc shell's SLURM_NTASKS would make the run refuse to start)."""
    import submitit

    if getattr(executor, "cluster", "") != "local":
        return submitit.helpers.CommandFunction(command, cwd=str(quality_runs.ROOT))
    env = quality_runs.run_env({k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    return submitit.helpers.CommandFunction(command, cwd=str(quality_runs.ROOT), env=env)


def make_executor(args: argparse.Namespace) -> Any:
    """submitit's SLURM executor (one GPU, one task, one node per run) or its local executor."""
    import submitit

    executor = submitit.AutoExecutor(folder=str(args.root / "submitit"), cluster=args.executor)
    executor.update_parameters(name=f"quality_{Path(args.plan).stem}", timeout_min=args.time, nodes=1,
                               tasks_per_node=1, cpus_per_task=args.cpus_per_task)
    if args.executor == "slurm":
        extra = {k: v for k, v in (("slurm_partition", args.partition), ("slurm_account", args.account)) if v}
        executor.update_parameters(gpus_per_node=1, slurm_array_parallelism=args.array_parallelism,
                                   slurm_setup=["export PYTHONUNBUFFERED=1"], **extra)
    return executor


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_quality --plan", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--plan", required=True, help="plan file, or a name of distsparse/configs/plans/")
    add("--plan-set", action="append", default=[], metavar="KEY=VALUE",
        help="change one plan key (repeatable), e.g. --plan-set model=tiny --plan-set steps=8")
    add("--data", required=True, help="prepared data directory (data_prep)")
    add("--root", required=True, type=Path, help="run directories: ROOT/seed<S>/<method>/sweep_...")
    add("--executor", choices=("slurm", "local"), required=True)
    add("--time", default="180", help="time limit of one run's task, in SLURM's forms (default 180 minutes)")
    add("--partition", default="", help="SLURM partition")
    add("--account", default="", help="SLURM account")
    add("--cpus-per-task", type=int, default=8, help="CPUs per run's task (default 8)")
    add("--array-parallelism", type=int, default=64, help="SLURM tasks of one array at once (default 64)")
    add("--local-parallel", type=int, default=1, help="local executor: runs at once (default 1; 0: the whole stage)")
    add("--keep-checkpoint", action="store_true", help="keep each run's final checkpoint")
    add("--json", type=Path, default=None, help="quality_summary's JSON (default ROOT/summary.json)")
    args = p.parse_args(argv)
    args.root = args.root.resolve()
    try:
        args.time = parse_time(args.time)
    except ValueError as err:
        p.error(str(err))
    for key in ("cpus_per_task", "array_parallelism"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}: got {getattr(args, key)}; allowed: >= 1")
    if args.local_parallel < 0:
        p.error(f"--local-parallel: got {args.local_parallel}; allowed: >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        plan = load_plan(args.plan, args.plan_set)
        plan.keep_checkpoint = plan.keep_checkpoint or args.keep_checkpoint
        first = stage_runs(plan, args.data, args.root, 0, {})   # unknown presets and bad settings fail here
        for r in first:
            refuse_to_replace(r.args, r.spec)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    executor = make_executor(args)
    parallel = args.local_parallel if args.executor == "local" else 0
    best: dict[str, tuple[float, ...]] = {}
    scores: dict[str, dict[tuple[float, ...], float]] = {}
    for stage, name in enumerate(STAGES):
        runs = first if stage == 0 else stage_runs(plan, args.data, args.root, stage, best)
        print(f"stage {stage + 1}/{len(STAGES)}: {name}, {len(runs)} runs", flush=True)
        try:
            outcomes = run_stage(runs, executor, parallel)
        except RunInTheWay as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        unfinished = [r for r in runs if not finished_earlier(r.args, r.spec)]
        if unfinished:
            names = ", ".join(f"{r.spec.out_dir.relative_to(args.root)}" for r in unfinished)
            print(f"error: stage {stage + 1} ({name}): {len(unfinished)} runs did not finish: {names}; run the same "
                  "command again to retrain them (finished runs are read back)", file=sys.stderr)
            return 1
        if stage < 2:
            best = record_seed0(scores, runs, outcomes)
            missing = [m for m in plan.methods if m not in best]
            if missing:
                print(f"error: stage {stage + 1} ({name}): no finite final PPL for {', '.join(missing)}; widen "
                      "plan.backbone_lr_scales towards lower rates", file=sys.stderr)
                return 1
            print("  best seed-0 points: " + "; ".join(f"{m} {point_name(*k)}"
                                                        for m, k in best.items()), flush=True)
    return quality_summary.main(["--root", str(args.root), "--json", str(args.json or args.root / "summary.json")])
