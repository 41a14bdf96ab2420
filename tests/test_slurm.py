"""launch/slurm.py (issue 7 item 5, issue 15 item 2): a job run through submitit's local executor is interrupted by
the timeout signal, checkpoints, is requeued by submitit and resumes to the end, with one task per rank and with
one torchrun per node; cluster options reach the sbatch file; `train.dtype: auto` is resolved on the node that
trains; bad arguments are refused before anything is submitted.

submitit's `LocalJob._interrupt()` cannot be used: it sends USR2 to the local controller process, which has no
handler for it and dies (the tasks are orphaned, nothing is requeued). The test sends USR2 to the rank-0 task
itself, which is what SLURM does for submitit (`--signal=USR2@signal_delay_s`) and what the local controller
does to its tasks `signal_delay_s` before the time limit.
"""

import json
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import psutil
import pytest
import torch

from distsparse.checkpoint import CheckpointManager
from distsparse.cli import pretrain, slurm
from distsparse.cli.launch_env import free_port
from distsparse.train.trainer import TrainResult
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40
TRAIN = ["--ds_config", str(ROOT / "configs/ds/zero2.json"), "model.preset=tiny", "data.seq_len=32",
         "train.dtype=fp32", f"train.steps={STEPS}", "train.micro_batch=2", "train.eval_interval=1000",
         "train.eval_samples=8", "train.log_interval=1", "method.preset=chtsnm_nobranch_1of4_row",
         "method.topology.update_interval=5"]
DEADLINE_S = 600


def _read(path) -> str:
    return Path(path).read_text() if Path(path).exists() else ""


def _wait_for(condition, job, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        if job.done():
            raise AssertionError(f"the job ended while waiting for {what}:\n{_read(job.paths.stderr)[-3000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _task_pid(job, rank: int) -> int:
    """The pid of one task of a local job: a child of the controller with that SUBMITIT_LOCAL_GLOBALID."""
    controller = job._process.pid
    found: list[int] = []

    def look() -> bool:
        for child in Path(f"/proc/{controller}/task/{controller}/children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in environ:
                found.append(int(child))
                return True
        return False
    _wait_for(look, job, f"task {rank} to start")
    return found[0]


def _loss_steps(out_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(out_dir / "tb"))
    ea.Reload()
    return [e.step for e in ea.Scalars("loss/train")]


@pytest.mark.parametrize("launcher", ["tasks", "torchrun"])
def test_local_job_interrupted_by_the_timeout_signal_is_requeued_and_resumes_to_the_end(launcher, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = make_data_dir(tmp_path / "data")
    out = tmp_path / "run"
    job = slurm.submit(["--executor", "local", "--launcher", launcher, "--tasks-per-node", "2", "--time", "10",
                        "--output-dir", str(tmp_path / "submitit"), *TRAIN, f"data.dir={data}", f"train.out_dir={out}"])
    try:
        rank0 = _task_pid(job, 0)
        _wait_for(lambda: "step 2/" in _read(job.paths.stderr), job, "training to start")
        os.kill(rank0, signal.SIGUSR2)   # to rank 0's task only (torchrun: the node's task), as submitit does
        if launcher == "torchrun":
            # SLURM may signal every process of the step: torchrun itself must survive USR2 (the workers here get
            # it only through the node task's forwarding).
            for torchrun in psutil.Process(rank0).children():
                torchrun.send_signal(signal.SIGUSR2)
        end = time.monotonic() + DEADLINE_S
        while not job.done() and time.monotonic() < end:
            time.sleep(0.2)
        results = job.results()
    finally:
        if not job.done():
            job.cancel()
    log = _read(job.paths.stderr)
    assert "handing the requeue to submitit" in log
    assert "Requeued job" in _read(job.paths.stdout)   # submitit's own requeue path (local: exit code 144)
    resumed = re.search(r"resumed from (\S+) at step (\d+) \(saved on 2 ranks, now 2\)", log)
    assert resumed, log[-3000:]
    k = int(resumed.group(2))
    assert 2 <= k < STEPS and Path(resumed.group(1)).name == f"step{k:08d}"
    # Both incarnations together logged every step once: the counter continued from the checkpoint.
    assert _loss_steps(out) == list(range(1, STEPS + 1))
    assert f"launch: {'submitit' if launcher == 'tasks' else 'torchrun'}, rank 0 of world 2" in log
    # tasks: one result per rank; torchrun: one per node task.
    assert [r["step"] for r in results] == [STEPS] * len(results) and not any(r["preempted"] for r in results)
    final = CheckpointManager(out / "checkpoints").find("auto")
    assert final.manifest["step"] == STEPS and final.manifest["world_size"] == 2


@pytest.mark.parametrize("text, minutes", [("90", 90), ("1:30", 2), ("24:00:00", 1440), ("2-00", 2880),
                                           ("1-02:30", 1590), ("0-00:00:61", 2)])
def test_time_limits_in_slurm_forms_convert_to_whole_minutes(text, minutes):
    assert slurm.parse_time(text) == minutes


def test_sbatch_file_carries_the_cluster_options(tmp_path, fake_srun):
    args, _ = slurm.parse_args(["--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu", "--account", "proj",
                                "--qos", "high", "--time", "1-00:00:00", "--job-name", "llama60m", "--cpus-per-task",
                                "10", "--output-dir", str(tmp_path / "sub")])
    text = slurm.make_executor(args)._make_submission_file_text("CMD", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--account=proj",
                 "--qos=high", "--time=1440", "--job-name=llama60m", "--cpus-per-task=10", "--signal=USR2@120"):
        assert f"#SBATCH {line}\n" in text, (line, text)


def test_bad_arguments_are_refused_before_anything_is_submitted(tmp_path, capsys):
    data = make_data_dir(tmp_path / "data")
    sub = tmp_path / "sub"
    base = ["--executor", "local", "--output-dir", str(sub), *TRAIN, f"data.dir={data}"]
    cases = [(["checkpoint.resume=/elsewhere/step00000010"], "checkpoint.resume: got '/elsewhere/step00000010'"),
             (["train.stepz=3"], "unknown config key 'train.stepz'"),
             (["--nodes", "2"], "--nodes: got 2 with --executor local"),
             (["--time", "soon"], "--time: got 'soon'")]
    for extra, message in cases:
        assert slurm.main(base + extra) == 2
        assert message in capsys.readouterr().err
    assert not sub.exists()



class _ExportedByHand:
    """submitit's TorchDistributedEnvironment outside a job: the test has already set what export() sets."""

    rank = 0

    def export(self, **kwargs):
        return self


class _TrainerThatRecords:
    seen: dict = {}

    def __init__(self, cfg, ds_config):
        _TrainerThatRecords.seen = {"cfg": cfg, "ds_config": ds_config}
        self.preemption = SimpleNamespace(received=None, previous={})

    def train(self):
        return TrainResult(step=1, train_loss=1.0, val_loss=1.0, val_ppl=2.7)

    def close(self):
        pass


def test_auto_dtype_is_resolved_on_the_node_that_trains_not_on_the_submitting_machine(tmp_path, monkeypatch):
    """Submitted from a CPU login node, run on a GPU node: the job's DeepSpeed config has bf16 and DeepSpeed's
    fused Adam (no torch_adam), as `build_ds_config` gives on the GPU node itself."""
    import deepspeed

    import distsparse.train.trainer as trainer_module
    from distsparse.config import load_config
    from distsparse.train.deepspeed.config import build_ds_config

    data = make_data_dir(tmp_path / "data")
    ds_file = tmp_path / "zero2_fused_adam.json"   # no torch_adam: the dense side's Adam is left to the node
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW",
                                                                                   "params": {"eps": 1e-8}}}))
    train = ["--ds_config", str(ds_file), *[a for a in TRAIN[2:] if not a.startswith("train.dtype=")],
             f"data.dir={data}", "train.dtype=auto"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)            # the login node
    cfg, carried = slurm.resolve_run(pretrain.parse_args(train))
    job = cloudpickle.loads(cloudpickle.dumps(slurm.TrainingJob(cfg, carried)))   # what submitit stores and loads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)             # the GPU node
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)   # restored after the test, whatever the job exports
    monkeypatch.setattr(slurm.submitit.helpers, "TorchDistributedEnvironment", _ExportedByHand)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *args, **kwargs: None)   # no NCCL here
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: None)
    monkeypatch.setattr(trainer_module, "Trainer", _TrainerThatRecords)
    job()
    ds = _TrainerThatRecords.seen["ds_config"]
    assert ds["bf16"]["enabled"] is True and "torch_adam" not in ds["optimizer"]["params"]
    on_the_node = build_ds_config(ds_file, load_config(None, [*train[2:], slurm.RESUME]))
    assert ds == on_the_node


def test_a_deepspeed_file_that_fails_on_a_gpu_node_is_refused_at_submit_time_on_a_cpu_machine(tmp_path, capsys,
                                                                                              monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = make_data_dir(tmp_path / "data")
    train = [a for a in TRAIN[2:] if not a.startswith("train.dtype=")]
    argv = ["--output-dir", str(tmp_path / "sub"), "--ds_config", str(ROOT / "configs/ds/zero1.json"), *train,
            f"data.dir={data}", "train.dtype=auto"]
    assert slurm.main(argv) == 2
    assert "got 1 with train.dtype bf16" in capsys.readouterr().err
    assert not (tmp_path / "sub").exists()


def test_torchrun_mode_runs_one_task_per_node_each_starting_torchrun_with_a_rendezvous_at_the_first_node(
        tmp_path, monkeypatch):
    from torch.distributed.run import get_args_parser

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\n")
    (fake / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")   # submitit looks for srun
    args, _ = slurm.parse_args(["--launcher", "torchrun", "--nodes", "4", "--gpus-per-node", "8",
                                "--cpus-per-task", "64", "--output-dir", str(tmp_path / "sub")])
    text = slurm.make_executor(args)._make_submission_file_text("CMD", "uid")
    for line in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64"):
        assert f"#SBATCH {line}\n" in text, (line, text)
    command = slurm.torchrun_command(4, slurm.tasks_per_node(args), "gpu07:41234", "987", tmp_path / "run")
    # Read back by torchrun's own parser: what every node runs.
    parsed = get_args_parser().parse_args(command[3:])
    assert command[:3] == [slurm.sys.executable, "-m", "torch.distributed.run"]
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id,
            parsed.max_restarts) == ("4", "8", "c10d", "gpu07:41234", "987", 0)
    assert (parsed.module, parsed.training_script) == (True, "distsparse.cli.pretrain")   # works installed too
    worker = pretrain.parse_args(parsed.training_script_args)
    assert (worker.config, worker.ds_config, worker.result_json) == tuple(
        str(tmp_path / "run" / name) for name in ("config.yaml", "ds_config.json", "result.json"))

# research/pretraining_ecosystem.md s1.2: steps (warmup) per size at global batch 512.
RECIPE = {"60m": (10000, 1000), "130m": (20000, 2000), "350m": (60000, 6000), "1b": (100000, 10000)}


@pytest.mark.parametrize("path", sorted((ROOT / "configs/experiments").glob("paper_*.yaml")), ids=lambda p: p.stem)
def test_paper_configs_carry_the_c4_recipe_at_global_batch_512(path):
    from distsparse.config import load_config
    cfg = load_config(path)
    assert path.stem.startswith(f"paper_{cfg.model.preset}_{cfg.method.name}")
    assert (cfg.train.steps, cfg.train.warmup_steps) == RECIPE[cfg.model.preset]
    assert (cfg.data.seq_len, cfg.train.min_lr_ratio, cfg.model.vocab_size) == (256, 0.1, 32000)
    world = int(re.search(r"World size assumed: (\d+) GPUs", path.read_text()).group(1))
    from distsparse.train.batch import resolve_batch
    assert cfg.train.global_batch_size == 512   # the truth; the accumulation follows from the world size
    for ranks in (world, world // 2, world // 4):
        plan = resolve_batch(cfg.train, ranks)
        assert plan.global_batch == cfg.train.micro_batch * plan.grad_accum * ranks == 512, (ranks, plan)
