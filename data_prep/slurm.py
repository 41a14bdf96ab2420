"""Prepare across nodes: a preparation's parts split across a submitit array of SLURM jobs (issue 30 item 4).

    python -m data_prep.prepare --source files:'c4/en/c4-train.*.json.gz' --out data/c4 --tokenizer DIR \\
        --max-tokens 20000000000 --executor slurm --tasks 16 --num-proc 32 --partition cpu --time 4:00:00

The command plans the parts and installs (or trains) the tokenizer where it runs, submits `--tasks` array jobs
and waits for them; task t prepares parts t, t + T, t + 2T, ... on `--num-proc` workers (launch/slurm.py's
submitit, `--cpus-per-task` defaults to `--num-proc`), each skipping the parts the budget no longer needs (it
reads the other tasks' records in the shared --out). A task that reaches its time limit is requeued by submitit
and continues from its finished parts. When all are done, the final step here checks every shard (sha256, counts)
and writes meta.json. If this command is interrupted, the array keeps running; running the same command again
submits only what is missing (do not do that while the first array still runs). --out must be on a filesystem
that every node sees. `--executor submitit-local` runs the same array through submitit's local executor.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import submitit

from data_prep.plan import Plan

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLURM (--executor slurm or submitit-local)")
    group.add_argument("--tasks", type=int, default=8, help="array jobs the parts are split across")
    group.add_argument("--partition")
    group.add_argument("--account")
    group.add_argument("--qos")
    group.add_argument("--time", default="4:00:00", help="time limit per task: MIN, HH:MM:SS or D-HH:MM:SS")
    group.add_argument("--cpus-per-task", type=int, help="default: --num-proc")
    group.add_argument("--mem-gb", type=float)
    group.add_argument("--job-name", default="data_prep")
    group.add_argument("--submitit-dir", type=Path, help="job pickles and logs (default: OUT/submitit)")


class PrepTask(submitit.helpers.Checkpointable):
    """Array task `task` of `num_tasks`: the plan's parts p with p % num_tasks == task. Checkpointable: submitit
    requeues it at its time limit with the same arguments, and it continues from the finished parts."""

    def __init__(self, out: str, task: int, num_tasks: int, num_proc: int) -> None:
        self.out, self.task, self.num_tasks, self.num_proc = out, task, num_tasks, num_proc

    def __call__(self) -> list[float]:
        from data_prep.prepare import run_local
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        plan = Plan.load(Path(self.out))
        return run_local(plan, self.num_proc, mine=lambda index: index % self.num_tasks == self.task)


def make_executor(args: argparse.Namespace, folder: Path, num_proc: int) -> submitit.Executor:
    from distsparse.cli.slurm import parse_time
    if args.tasks < 1:
        raise ValueError(f"--tasks: got {args.tasks}; allowed: >= 1")
    minutes = parse_time(args.time)
    if args.executor == "submitit-local":
        executor = submitit.LocalExecutor(str(folder))
        executor.update_parameters(timeout_min=minutes)
        return executor
    executor = submitit.SlurmExecutor(str(folder))
    params = {"job_name": args.job_name, "time": minutes, "partition": args.partition, "account": args.account,
              "qos": args.qos, "cpus_per_task": args.cpus_per_task or num_proc, "nodes": 1, "ntasks_per_node": 1,
              "mem": None if args.mem_gb is None else f"{args.mem_gb:g}GB"}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def array_runner(args: argparse.Namespace, num_proc: int):
    """prepare()'s runner: submit the array, wait for every task, return the workers' peak RSS."""
    def run(plan: Plan) -> list[float]:
        folder = args.submitit_dir or plan.out / "submitit"
        executor = make_executor(args, Path(folder), num_proc)
        with executor.batch():
            jobs = [executor.submit(PrepTask(str(plan.out), t, args.tasks, num_proc)) for t in range(args.tasks)]
        log.info("submitted %d tasks (%s); logs in %s", len(jobs), jobs[0].job_id.split("_")[0], folder)
        rss: list[float] = []
        for t, job in enumerate(jobs):
            try:
                rss += job.result()
            except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
                last = next((line for line in reversed(str(err).splitlines()) if line.strip()), "")
                raise ValueError(f"task {t} of the preparation failed ({last}); log: {job.paths.stderr}; allowed: "
                                 f"fix the cause and rerun the same command (finished parts are kept)") from None
        return rss
    return run
