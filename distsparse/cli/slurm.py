"""Submit a pre-training run to SLURM through submitit, or run the same job through submitit's local executor.

    python launch/slurm.py --nodes 2 --gpus-per-node 8 --partition gpu --account proj --time 24:00:00 \\
        --job-name llama60m --output-dir runs/slurm \\
        --config configs/experiments/paper_60m_chtsnm_1of4_row.yaml --ds_config configs/ds/zero2.json train.steps=100
    python launch/slurm.py --launcher torchrun --nodes 2 --gpus-per-node 8 ...     # one torchrun per node
    python launch/slurm.py --executor local --tasks-per-node 2 --time 30 --config ... key=value   # CPU, gloo

The training arguments are launch/pretrain.py's (`--config`, `--ds_config`, `key=value`; `--print-config` and
`--dry-run` run here and submit nothing); they are parsed and validated by the same functions before anything
is submitted. `--tasks-per-node` ranks per node (default `--gpus-per-node`, or 1 without GPUs), started by one of
two launchers:
- `--launcher tasks` (default): SLURM starts one task per rank; each task is a rank (TrainingJob).
- `--launcher torchrun`: SLURM starts one task per node; each runs `torchrun --nproc-per-node <ranks per node>`
  with a c10d rendezvous at the first node (TorchrunJob), as `torchrun` would be run by hand.

The job carries the run config and the *contents* of the DeepSpeed JSON, and completes the DeepSpeed config on the
node that trains, so `train.dtype: auto` is the node's answer (bf16 with CUDA), not the login node's. At submit
time the DeepSpeed JSON is checked for both answers (the local executor: for this machine's).

Inside a `tasks` job (research/pretraining_ecosystem.md s4; DESIGN decisions 14, 17):
- `TorchDistributedEnvironment().export(set_cuda_visible_devices=False)` sets RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT; distsparse/cli/launch_env.py reads them back and selects the GPU LOCAL_RANK modulo the
  visible devices (one GPU per task or all GPUs per task both work). DeepSpeed initializes from them.
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

Inside a `torchrun` job (one submitit task per node, the "node task"):
- torchrun runs as a child process (`python -m torch.distributed.run`), not in-process, so that submitit's
  handlers stay the node task's: torchrun (torch/distributed/elastic/multiprocessing/api.py, `start`) installs
  handlers only for TORCHELASTIC_SIGNALS_TO_HANDLE (default SIGTERM, SIGINT, SIGHUP, SIGQUIT); on one of those it
  sends the same signal to every worker, waits its shutdown timeout (30 s by default) and then SIGKILLs them
  (elastic/agent/server/api.py `run`, local_elastic_agent.py `_shutdown`) and exits non-zero. SIGUSR1/SIGUSR2 it
  does not handle: their default action would kill torchrun at once, orphaning the workers in the middle of a
  step. So torchrun is started with SIGUSR1/SIGUSR2 ignored (inherited through exec by torchrun and its workers,
  until each worker's trainer installs its own flag handlers), and the node task forwards the USR1/USR2 it
  receives to torchrun's workers (SLURM may also signal every process of the step: a second delivery only sets
  the same flag). The workers agree, save and exit 0, torchrun exits 0, and the first node task then hands USR2
  to submitit's handler to requeue, as above; each node's first worker reports the run's result in a file
  (launch/pretrain.py --result-json). SIGTERM keeps torchrun's own behaviour (forwarded to the workers, which
  save at the step boundary if that fits in torchrun's shutdown timeout; raise it with
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT where the installed torch reads it); the job then fails (not requeued) and
  resubmitting resumes from the newest complete checkpoint.
A USR2 that arrives before the workers' trainers have installed their handlers is ignored by the workers: the run
continues until SLURM ends it at the time limit, and resubmitting resumes.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import psutil   # a DeepSpeed dependency
import submitit
import yaml

from distsparse.cli import launch_env
from distsparse.config import Config, config_to_dict, load_config
from distsparse.train.deepspeed.config import complete_ds_config, read_ds_json
from distsparse.train.validate import validate
from distsparse.cli import pretrain

EXECUTORS = ("slurm", "local")
LAUNCHERS = ("tasks", "torchrun")
RESUME = "checkpoint.resume=auto"
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2)   # torchrun does not handle them: the node task forwards them
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
    p.add_argument("--launcher", choices=LAUNCHERS, default="tasks",
                   help="tasks: one SLURM task per rank; torchrun: one SLURM task per node running torchrun")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--tasks-per-node", type=int, default=None,
                   help="ranks per node (default: --gpus-per-node, or 1 without GPUs); with --launcher torchrun "
                        "torchrun's --nproc-per-node")
    p.add_argument("--cpus-per-task", type=int, default=None,
                   help="CPUs per SLURM task (with --launcher torchrun: for the whole node's ranks)")
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
    """Ranks per node."""
    return args.tasks_per_node or max(args.gpus_per_node, 1)


def slurm_tasks_per_node(args: argparse.Namespace) -> int:
    """Tasks SLURM starts per node: every rank, or one torchrun."""
    return 1 if args.launcher == "torchrun" else tasks_per_node(args)


def make_executor(args: argparse.Namespace) -> submitit.Executor:
    """submitit's SLURM or local executor with the options mapped onto its parameters."""
    common = {"gpus_per_node": args.gpus_per_node or None, "signal_delay_s": args.signal_delay_s}
    if args.executor == "local":
        ignored = [f"--{k.replace('_', '-')}" for k in ("partition", "account", "qos", "cpus_per_task", "mem_gb")
                   if getattr(args, k) is not None]
        if ignored:
            logging.warning("--executor local ignores %s", ", ".join(ignored))
        executor = submitit.LocalExecutor(args.output_dir, max_num_timeout=args.max_num_timeout)
        params = {**common, "timeout_min": parse_time(args.time), "tasks_per_node": slurm_tasks_per_node(args)}
    else:
        executor = submitit.SlurmExecutor(args.output_dir, max_num_timeout=args.max_num_timeout)
        params = {**common, "job_name": args.job_name, "nodes": args.nodes,
                  "ntasks_per_node": slurm_tasks_per_node(args), "time": parse_time(args.time),
                  "partition": args.partition, "account": args.account, "qos": args.qos,
                  "cpus_per_task": args.cpus_per_task, "mem": None if args.mem_gb is None else f"{args.mem_gb:g}GB"}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def resolve_run(train_args: argparse.Namespace, node_cuda: tuple[bool, ...] = (False, True),
                world_size: int = 1) -> tuple[Config, dict]:
    """The run's config with resume forced to auto, and the contents of its DeepSpeed JSON, validated as
    launch/pretrain.py does before any process group starts, for a training node with and without CUDA
    (`node_cuda`: the answers of `torch.cuda.is_available()` the node may give)."""
    given = load_config(train_args.config, train_args.overrides)
    if given.checkpoint.resume not in ("", "auto"):
        raise ValueError(f"checkpoint.resume: got {given.checkpoint.resume!r}; allowed under launch/slurm.py: "
                         f"'' or 'auto' (a requeued job resumes from the run's own newest checkpoint)")
    cfg = load_config(train_args.config, [*train_args.overrides, RESUME])
    ds_source = read_ds_json(train_args.ds_config)
    for cuda in node_cuda:
        try:
            complete_ds_config(ds_source, cfg, cuda_available=cuda)
        except ValueError as err:
            raise ValueError(f"{err} (as the job would resolve it on a node {'with' if cuda else 'without'} "
                             f"CUDA, train.dtype {cfg.train.dtype!r})") from None
    validate(cfg, world_size=world_size)
    return cfg, ds_source


def _start_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)


class TrainingJob(submitit.helpers.Checkpointable):
    """The job every task runs (`--launcher tasks`). Holds only the resolved run config and the DeepSpeed JSON's
    contents, so `checkpoint()` (Checkpointable's: the same callable again) resubmits a job that resumes by
    itself."""

    def __init__(self, cfg: Config, ds_source: dict):
        self.cfg, self.ds_source = cfg, ds_source

    def __call__(self) -> dict:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        env = launch_env.resolve_here()
        _start_logging(env.rank)
        ds_config = complete_ds_config(self.ds_source, self.cfg)   # here, on the node that trains
        device = launch_env.start(env)
        logging.info(launch_env.describe(env, device))
        from distsparse.train.trainer import Trainer
        trainer = Trainer(self.cfg, ds_config)
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


def torchrun_command(nnodes: int, nproc_per_node: int, endpoint: str, run_id: str, run_dir: Path) -> list[str]:
    """What each node task runs: torchrun with a c10d rendezvous at `endpoint` (the first node), no elastic
    restarts (a failure ends the job; requeues are submitit's), launch/pretrain.py on the files in `run_dir`."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", "--max-restarts=0", "--module", "distsparse.cli.pretrain",
            "--config", str(run_dir / "config.yaml"), "--ds_config", str(run_dir / "ds_config.json"),
            "--result-json", str(run_dir / "result.json")]


def _forwarded_signals() -> tuple[signal.Signals, ...]:
    """USR1, USR2 and submitit's timeout signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL says otherwise)."""
    return tuple(dict.fromkeys((*FORWARDED, submitit.JobEnvironment._usr_sig())))


def _ignore(signals: tuple[signal.Signals, ...]) -> None:
    """In torchrun's child before exec: SIG_IGN survives exec, a Python handler would not."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


class TorchrunJob(submitit.helpers.Checkpointable):
    """The job of each node's single task (`--launcher torchrun`): writes the run config and the DeepSpeed JSON's
    contents for launch/pretrain.py, runs torchrun, forwards USR1/USR2 to its workers, and requeues through
    submitit when the run stopped for the timeout signal (module docstring)."""

    def __init__(self, cfg: Config, ds_source: dict, nproc_per_node: int):
        self.cfg, self.ds_source, self.nproc_per_node = cfg, ds_source, nproc_per_node

    def __call__(self) -> dict:
        job = submitit.JobEnvironment()
        rendezvous = submitit.helpers.TorchDistributedEnvironment()   # first host, port derived from the job id
        _start_logging(job.global_rank)
        usr_sig = submitit.JobEnvironment._usr_sig()
        with tempfile.TemporaryDirectory(prefix="distsparse_torchrun_") as tmp:
            run_dir = Path(tmp)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False))
            (run_dir / "ds_config.json").write_text(json.dumps(self.ds_source))   # completed by each worker
            command = torchrun_command(job.num_nodes, self.nproc_per_node,
                                       f"{rendezvous.master_addr}:{rendezvous.master_port}", job.job_id, run_dir)
            logging.info("node %d of %d: %s", job.node, job.num_nodes, " ".join(command))
            code, received, previous = _run_forwarding_signals(command)
            if code != 0:
                raise RuntimeError(f"torchrun exited with code {code} on node {job.node} (its workers' logs are "
                                   f"above in this task's log)")
            result = json.loads((run_dir / "result.json").read_text())
        if result["preempted"] and job.global_rank == 0 and usr_sig in received:
            logging.info("checkpoint written at step %d: handing the requeue to submitit", result["step"])
            previous[usr_sig](usr_sig, None)   # submitit's checkpoint(), requeue and exit: does not return here
        if result["preempted"] and job.global_rank == 0:
            logging.warning("stopped by %s at step %d with a checkpoint; not requeued (only %s is); resubmit the "
                            "same command to resume", result["signal"], result["step"], usr_sig.name)
        return result


def _run_forwarding_signals(command: list[str]) -> tuple[int, list[int], dict]:
    """Run torchrun with USR1/USR2 ignored, forwarding those this process receives meanwhile to its workers.
    Returns (exit code, signals received, the handlers that were in place: submitit's)."""
    env = {k: v for k, v in os.environ.items()   # torchrun sets the rendezvous variables of its workers
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    received: list[int] = []
    procs: list[subprocess.Popen] = []
    forwarded = _forwarded_signals()

    def forward(signum, frame) -> None:
        received.append(signum)
        for proc in procs:
            _signal_workers(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in forwarded}   # before torchrun starts
    try:
        procs.append(subprocess.Popen(command, env=env, preexec_fn=functools.partial(_ignore, forwarded)))
        code = procs[0].wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, received, previous


def _signal_workers(torchrun_pid: int, signum: int) -> None:
    """Send `signum` to torchrun's workers (its child processes), not to torchrun itself."""
    try:
        children = psutil.Process(torchrun_pid).children()
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def submit(argv: list[str]) -> submitit.Job:
    """Validate everything, submit the job, print where to follow it; ValueError for bad arguments."""
    args, rest = parse_args(argv)
    check_cluster_args(args)
    node_cuda = (False, True) if args.executor == "slurm" else (_cuda_here(),)
    cfg, ds_source = resolve_run(pretrain.parse_args(rest), node_cuda, args.nodes * tasks_per_node(args))
    executor = make_executor(args)
    ranks = tasks_per_node(args)
    work = TrainingJob(cfg, ds_source) if args.launcher == "tasks" else TorchrunJob(cfg, ds_source, ranks)
    # The submitting shell may itself be a SLURM job or a torchrun worker: keep its variables out of the job.
    with submitit.helpers.clean_env():
        job = executor.submit(work)
    print(f"submitted job {job.job_id} ({args.executor}, {args.launcher}: {args.nodes} node(s) x {ranks} rank(s), "
          f"{parse_time(args.time)} min, requeued after a time limit up to {args.max_num_timeout} times)")
    print(f"logs (rank 0):  {job.paths.stdout}\n                {job.paths.stderr}")
    if args.nodes * slurm_tasks_per_node(args) > 1:
        print(f"other tasks:    {job.paths.folder}/{job.job_id}_<rank>_log.{{out,err}}")
    print(f"checkpoints:    {cfg.checkpoint.dir or Path(cfg.train.out_dir) / 'checkpoints'}")
    print(f"tensorboard:    tensorboard --logdir {Path(cfg.train.out_dir) / 'tb'}")
    return job


def _cuda_here() -> bool:
    import torch
    return torch.cuda.is_available()


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
    # The package's module, not this __main__ copy, so that the pickled job classes name distsparse.cli.slurm.
    from distsparse.cli.slurm import main as package_main
    sys.exit(package_main())
