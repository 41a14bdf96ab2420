"""Submit a pre-training run to SLURM through submitit, or run the same job through submitit's local executor.

    python launch/slurm.py --nodes 2 --gpus-per-node 8 --partition gpu --account proj --time 24:00:00 \\
        --job-name llama60m --output-dir runs/slurm \\
        --config configs/experiments/paper_60m_chtsnm_1of4_row.yaml --ds_config configs/ds/zero2.json train.steps=100
    python launch/slurm.py --executor local --tasks-per-node 2 --time 30 --config ... key=value   # CPU, gloo

The training arguments are launch/pretrain.py's (`--config`, `--ds_config`, `key=value`; `--print-config` and
`--dry-run` run here and submit nothing); they are parsed and validated by the same functions before anything
is submitted. One task per GPU (`--tasks-per-node` defaults to `--gpus-per-node`, or 1 without GPUs).

Inside the job (research/pretraining_ecosystem.md s4; DESIGN decision 14):
- `TorchDistributedEnvironment().export(set_cuda_visible_devices=False)` sets RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT; CUDA_VISIBLE_DEVICES is left alone because DeepSpeed selects the device by
  LOCAL_RANK (narrowing it to one GPU makes LOCAL_RANK > 0 an invalid ordinal). DeepSpeed initializes from them.
- `checkpoint.resume=auto` is forced: the first run starts fresh (no checkpoint yet), a requeued one resumes
  from the newest complete checkpoint under the run's checkpoint directory.
- submitit installs its handlers first, then the trainer installs the project's (they only set a flag).
  When the timeout signal (USR2, sent by SLURM `signal_delay_s` before the time limit, to rank 0 at least)
  arrives, all ranks agree at the step boundary, save a checkpoint and the trainer returns preempted. Then rank 0
  hands the signal to submitit's own handler, which requeues exactly as submitit does: it calls this job's
  `checkpoint()` (Checkpointable: the same job again), writes the new submission, runs `scontrol requeue`
  (local executor: exits with code 144, which makes the local controller restart the tasks) and exits; the
  other ranks return normally (exit code 0). SIGTERM/SIGUSR1 also stop the run with a checkpoint, but are not
  requeued here (SIGTERM is also what `scancel` sends); resubmitting the same command resumes.
A USR2 that arrives before the trainer has installed its handlers reaches submitit's handler directly: rank 0
requeues at once from the previous checkpoint, and the other ranks wait in a collective until SLURM ends them.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import submitit

from distsparse.config import Config, load_config
from distsparse.train.ds_config import build_ds_config
from distsparse.train.validate import validate
from launch import pretrain

EXECUTORS = ("slurm", "local")
RESUME = "checkpoint.resume=auto"
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str) -> int:
    """SLURM time forms -> whole minutes: MIN, MIN:SEC, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    m = _TIME.match(text.strip())
    if not m:
        raise ValueError(f"--time: got {text!r}; allowed: MIN, HH:MM:SS, D-HH:MM:SS (SLURM's forms)")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:      # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:       # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    else:                     # MIN or MIN:SEC
        seconds = a * 60 + (b or 0)
    if seconds < 60:
        raise ValueError(f"--time: got {text!r}; allowed: at least one minute")
    return -(-seconds // 60)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(cluster options, launch/pretrain.py arguments)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--executor", choices=EXECUTORS, default="slurm")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--tasks-per-node", type=int, default=None, help="default: --gpus-per-node, or 1 without GPUs")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--mem-gb", type=float, default=None)
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--qos", default=None)
    p.add_argument("--time", default="60", help="time limit: MIN, HH:MM:SS or D-HH:MM:SS (default 60 minutes)")
    p.add_argument("--signal-delay-s", type=int, default=120,
                   help="seconds before the time limit at which USR2 asks the run to checkpoint and requeue")
    p.add_argument("--max-num-timeout", type=int, default=20, help="requeues allowed after a time limit")
    p.add_argument("--job-name", default="distsparse")
    p.add_argument("--output-dir", default="runs/slurm", help="submitit folder: job pickles and logs")
    return p.parse_known_args(argv)


def check_cluster_args(args: argparse.Namespace) -> None:
    """ValueError naming the option."""
    for key in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task", "signal_delay_s", "max_num_timeout"):
        value = getattr(args, key)
        low = 0 if key in ("gpus_per_node", "max_num_timeout") else 1
        if value is not None and value < low:
            raise ValueError(f"--{key.replace('_', '-')}: got {value}; allowed: an integer >= {low}")
    if args.executor == "local" and args.nodes != 1:
        raise ValueError(f"--nodes: got {args.nodes} with --executor local; allowed: 1 (submitit's local executor "
                         f"runs on this machine only)")
    parse_time(args.time)


def tasks_per_node(args: argparse.Namespace) -> int:
    return args.tasks_per_node or max(args.gpus_per_node, 1)


def make_executor(args: argparse.Namespace) -> submitit.Executor:
    """submitit's SLURM or local executor with the options mapped onto its parameters."""
    common = {"gpus_per_node": args.gpus_per_node or None, "signal_delay_s": args.signal_delay_s}
    if args.executor == "local":
        ignored = [f"--{k.replace('_', '-')}" for k in ("partition", "account", "qos", "cpus_per_task", "mem_gb")
                   if getattr(args, k) is not None]
        if ignored:
            logging.warning("--executor local ignores %s", ", ".join(ignored))
        executor = submitit.LocalExecutor(args.output_dir, max_num_timeout=args.max_num_timeout)
        params = {**common, "timeout_min": parse_time(args.time), "tasks_per_node": tasks_per_node(args)}
    else:
        executor = submitit.SlurmExecutor(args.output_dir, max_num_timeout=args.max_num_timeout)
        params = {**common, "job_name": args.job_name, "nodes": args.nodes, "ntasks_per_node": tasks_per_node(args),
                  "time": parse_time(args.time), "partition": args.partition, "account": args.account,
                  "qos": args.qos, "cpus_per_task": args.cpus_per_task,
                  "mem": None if args.mem_gb is None else f"{args.mem_gb:g}GB"}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def resolve_run(train_args: argparse.Namespace) -> tuple[Config, dict]:
    """The run's config with resume forced to auto, and its DeepSpeed config, validated as launch/pretrain.py
    does before any process group starts."""
    given = load_config(train_args.config, train_args.overrides)
    if given.checkpoint.resume not in ("", "auto"):
        raise ValueError(f"checkpoint.resume: got {given.checkpoint.resume!r}; allowed under launch/slurm.py: "
                         f"'' or 'auto' (a requeued job resumes from the run's own newest checkpoint)")
    cfg = load_config(train_args.config, [*train_args.overrides, RESUME])
    ds_config = build_ds_config(train_args.ds_config, cfg)
    validate(cfg)
    return cfg, ds_config


class TrainingJob(submitit.helpers.Checkpointable):
    """The job every task runs. Holds only the resolved configs, so `checkpoint()` (Checkpointable's: the same
    callable again) resubmits a job that resumes by itself."""

    def __init__(self, cfg: Config, ds_config: dict):
        self.cfg, self.ds_config = cfg, ds_config

    def __call__(self) -> dict:
        env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
        if env.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        import deepspeed
        import torch
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        from distsparse.train.trainer import Trainer
        trainer = Trainer(self.cfg, self.ds_config)
        try:
            result = trainer.train()
            received = trainer.preemption.received
            previous = dict(trainer.preemption.previous)   # submitit's handlers, installed before the trainer's
        finally:
            trainer.close()
        usr_sig = submitit.JobEnvironment._usr_sig()   # USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise
        if result.preempted and env.rank == 0 and received == usr_sig:
            logging.info("checkpoint written at step %d: handing the requeue to submitit", result.step)
            previous[usr_sig](usr_sig, None)   # submitit's checkpoint(), requeue and exit: does not return on rank 0
        if result.preempted and env.rank == 0:
            seen = signal.Signals(received).name if received else "a signal to another rank"
            logging.warning("stopped by %s at step %d with a checkpoint; not requeued (only %s is); resubmit the "
                            "same command to resume", seen, result.step, usr_sig.name)
        return asdict(result)


def submit(argv: list[str]) -> submitit.Job:
    """Validate everything, submit the job, print where to follow it; ValueError for bad arguments."""
    args, rest = parse_args(argv)
    check_cluster_args(args)
    cfg, ds_config = resolve_run(pretrain.parse_args(rest))
    executor = make_executor(args)
    # The submitting shell may itself be a SLURM job or a torchrun worker: keep its variables out of the job.
    with submitit.helpers.clean_env():
        job = executor.submit(TrainingJob(cfg, ds_config))
    tasks = tasks_per_node(args)
    print(f"submitted job {job.job_id} ({args.executor}: {args.nodes} node(s) x {tasks} task(s), "
          f"{parse_time(args.time)} min, requeued after a time limit up to {args.max_num_timeout} times)")
    print(f"logs (rank 0):  {job.paths.stdout}\n                {job.paths.stderr}")
    if args.nodes * tasks > 1:
        print(f"other ranks:    {job.paths.folder}/{job.job_id}_<rank>_log.{{out,err}}")
    print(f"checkpoints:    {cfg.checkpoint.dir or Path(cfg.train.out_dir) / 'checkpoints'}")
    print(f"tensorboard:    tensorboard --logdir {Path(cfg.train.out_dir) / 'tb'}")
    return job


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parse_args(argv)
    train_args = pretrain.parse_args(rest)
    if train_args.print_config or train_args.dry_run:
        return pretrain.main(rest)
    try:
        submit(argv)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # Import the job class from the package, not from __main__, so the pickled job names `launch.slurm`.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from launch.slurm import main as package_main
    sys.exit(package_main())
