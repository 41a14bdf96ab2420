"""distsparse/cli/launch_env.py (issue 15 item 2, DESIGN decision 17): every launcher's environment resolves to one
rank/world/local-rank record, srun alone forms one world, an unplaceable multi-task launch is refused with a
message that says how to launch, and the GPU is LOCAL_RANK modulo the visible devices.

The environments are what each launcher exports (deepspeed/launcher/launch.py, torch/distributed/run.py,
submitit's TorchDistributedEnvironment.export, srun's task environment), written out by hand. The last test runs
launch/pretrain.py as two srun tasks would (SLURM_* only) and checks that they train as one world of two.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distsparse.checkpoint import CheckpointManager
from distsparse.cli.launch_env import (PORT_MIN, PORT_SPAN, LaunchEnv, LaunchError, expand_nodelist, free_port,
                                       port_for_job, resolve, tasks_on_node)
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parent.parent


def no_port():
    raise AssertionError("a launch that names its port must not look for a free one")


def fixed_hosts(nodelist):
    raise AssertionError("a launch that names MASTER_ADDR must not expand the node list")


DEEPSPEED = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_SIZE": "8", "CROSS_RANK": "0",
             "CROSS_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
TORCHRUN = {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "1",
            "TORCHELASTIC_RUN_ID": "4242", "MASTER_ADDR": "node01", "MASTER_PORT": "29400"}
SUBMITIT = {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu003",
            "MASTER_PORT": "41234", "SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "9", "SLURM_NTASKS": "16",
            "SLURM_STEP_NUM_TASKS": "16"}


@pytest.mark.parametrize("environ, expected", [
    (DEEPSPEED, LaunchEnv("deepspeed", 5, 16, 5, 8, "node01", 29500)),
    (TORCHRUN, LaunchEnv("torchrun", 11, 16, 3, 8, "node01", 29400)),
    # RANK wins over the SLURM variables the submitit task also sees.
    (SUBMITIT, LaunchEnv("submitit", 9, 16, 1, 8, "gpu003", 41234)),
], ids=["deepspeed", "torchrun", "submitit"])
def test_each_launchers_environment_resolves_to_its_rank_world_and_local_rank(environ, expected):
    assert resolve(environ, hostnames=fixed_hosts, find_port=no_port) == expected


def srun_task(procid: int, localid: int, nodeid: int, **extra) -> dict:
    env = {"SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}
    return {**env, **extra}


def test_srun_tasks_take_their_ranks_from_slurm_and_meet_at_the_first_host_on_a_port_of_the_job():
    records = [resolve(srun_task(p, p % 4, p // 4), find_port=no_port) for p in range(8)]
    assert [(r.rank, r.world_size, r.local_rank, r.local_world_size) for r in records] == \
        [(p, 8, p % 4, 4) for p in range(8)]
    assert {(r.source, r.master_addr, r.master_port) for r in records} == {("srun", "gpu07", port_for_job(123456))}


def test_srun_step_port_is_the_jobs_and_steps_and_a_given_master_wins():
    a = resolve(srun_task(0, 0, 0), find_port=no_port).master_port
    b = resolve(srun_task(0, 0, 0, SLURM_STEP_ID="1"), find_port=no_port).master_port
    other_job = resolve(srun_task(0, 0, 0, SLURM_JOB_ID="123457"), find_port=no_port).master_port
    assert len({a, b, other_job}) == 3 and all(20000 <= p < 60000 for p in (a, b, other_job))
    given = resolve(srun_task(3, 3, 0, MASTER_ADDR="10.0.0.7", MASTER_PORT="23456"), hostnames=fixed_hosts,
                    find_port=no_port)
    assert (given.master_addr, given.master_port) == ("10.0.0.7", 23456)


def test_srun_with_one_task_and_plain_python_are_worlds_of_one_on_a_free_port():
    one = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0"}
    assert resolve(one, find_port=lambda: 31337) == LaunchEnv("srun", 0, 1, 0, None, "127.0.0.1", 31337)
    assert resolve({}, find_port=lambda: 31338) == LaunchEnv("single", 0, 1, 0, 1, "127.0.0.1", 31338)
    # A one-task SLURM allocation seen from its batch script is a world of one too, and so is `mpirun -np 1`.
    assert resolve({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, find_port=lambda: 31339).world_size == 1
    assert resolve({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, find_port=lambda: 31340) == \
        LaunchEnv("single", 0, 1, 0, 1, "127.0.0.1", 31340)
    # srun with an MPI plugin sets PMI_SIZE in every task: srun's own variables place it.
    assert resolve(srun_task(3, 3, 0, PMI_SIZE="8", PMI_RANK="3"), find_port=no_port).rank == 3


@pytest.mark.parametrize("environ, message", [
    # The batch script (or an salloc shell) of an 8-task allocation: not one of srun's tasks.
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "gpu[01-02]"},
     "SLURM_NTASKS is '8' but this process is not one of srun's tasks"),
    ({"WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "WORLD_SIZE is '4' but RANK is not set"),
    ({"RANK": "1"}, "RANK is set ('1') but WORLD_SIZE is not"),
    ({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "LOCAL_RANK is not set in a world of 4"),
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}, "MASTER_ADDR and MASTER_PORT not set in a world of 4"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
     "RANK: got 4 with WORLD_SIZE 4; allowed: 0 .. 3"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK: got 'x'; allowed: an integer >= 0"),
    ({**srun_task(0, 0, 0), "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, "no SLURM_STEP_NODELIST"),
    ({k: v for k, v in srun_task(1, 1, 0).items() if k != "SLURM_JOB_ID"}, "no SLURM_JOB_ID"),
    (srun_task(8, 0, 1), "SLURM_PROCID: got 8 with SLURM_STEP_NUM_TASKS 8; allowed: 0 .. 7"),
    # mpirun -np 8 (or deepspeed --launcher openmpi): Open MPI's own variables only, no RANK.
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3"},
     "OMPI_COMM_WORLD_SIZE is '8' but RANK is not set"),
    ({"PMI_SIZE": "4", "PMI_RANK": "1"}, "PMI_SIZE is '4' but RANK is not set"),
], ids=["batch-script", "world-without-rank", "rank-without-world", "no-local-rank", "no-master", "rank-range",
        "not-an-integer", "srun-no-nodelist", "srun-no-job-id", "srun-rank-range", "mpirun", "pmi"])
def test_a_launch_that_cannot_form_one_world_is_refused_with_how_to_launch(environ, message):
    with pytest.raises(LaunchError) as err:
        resolve(environ, find_port=lambda: 31337)
    assert message in str(err.value)
    if "allowed" not in message and "no SLURM" not in message:
        assert "srun --ntasks-per-node" in str(err.value) and "torchrun" in str(err.value)


@pytest.mark.parametrize("local_rank, visible, index", [
    (5, 8, 5),   # each task sees the node's 8 GPUs
    (5, 1, 0),   # SLURM binds one GPU per task (--gpus-per-task=1): the only visible device
    (3, 2, 1),   # two GPUs per task, two ranks per GPU pair
])
def test_device_is_local_rank_modulo_the_visible_devices(local_rank, visible, index):
    env = LaunchEnv("torchrun", local_rank, 8, local_rank, 8, "a", 1)
    assert env.device_index(visible) == index


def test_device_index_refuses_a_machine_without_devices():
    with pytest.raises(ValueError, match="device_count: got 0"):
        LaunchEnv("single", 0, 1, 0, 1, "a", 1).device_index(0)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("gpu[07-09]", ["gpu07", "gpu08", "gpu09"]),
    ("gpu[1-2,10],login3", ["gpu1", "gpu2", "gpu10", "login3"]),
    ("n[008-011]-ib", ["n008-ib", "n009-ib", "n010-ib", "n011-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[3],c[01-02]", ["a", "b3", "c01", "c02"]),
])
def test_slurm_node_lists_expand_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["gpu[1-", "gpu]1[", "gpu[3-1]", "gpu[a-b]", ""])
def test_malformed_node_lists_are_refused(nodelist):
    with pytest.raises(LaunchError, match="node list"):
        expand_nodelist(nodelist)


@pytest.mark.parametrize("text, node, count", [("4(x2)", 1, 4), ("2(x3),1", 3, 1), ("8", 0, 8), ("3,5", 1, 5)])
def test_tasks_per_node_forms(text, node, count):
    assert tasks_on_node(text, node) == count


# ---- srun alone, end to end -------------------------------------------------------------------------------------

def _srun_environment(procid: int, job_id: int, step_id: int) -> dict:
    """What srun gives each of two tasks on this one node (no MASTER_*, no RANK)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_JOB_ID=str(job_id), SLURM_STEP_ID=str(step_id), SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2",
               SLURM_PROCID=str(procid), SLURM_LOCALID=str(procid), SLURM_NODEID="0",
               SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
               PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def _job_and_step_for_a_free_port() -> tuple[int, int]:
    """A (job id, step id) whose derived port is free now, so the test does not collide with another run."""
    while True:
        port = free_port()
        if PORT_MIN <= port < PORT_MIN + PORT_SPAN:
            job, step = divmod(port - PORT_MIN, 100)
            assert port_for_job(job, step) == port
            return job, step


def test_srun_alone_forms_one_world_of_two_not_two_worlds_of_one(tmp_path):
    data = make_data_dir(tmp_path / "data")
    out = tmp_path / "run"
    job, step = _job_and_step_for_a_free_port()
    command = [sys.executable, str(ROOT / "launch/pretrain.py"), "--ds_config", str(ROOT / "configs/ds/zero2.json"),
               "model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row", "data.seq_len=32", "train.dtype=fp32",
               "train.steps=2", "train.micro_batch=2", "train.eval_interval=1000", "train.eval_samples=8",
               "checkpoint.interval=2", f"data.dir={data}", f"train.out_dir={out}"]
    procs = [subprocess.Popen(command, env=_srun_environment(p, job, step), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for p in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    final = CheckpointManager(out / "checkpoints").find("auto")
    assert final.manifest["step"] == 2 and final.manifest["world_size"] == 2
    assert f"launch: srun, rank 0 of world 2 (local rank 0 of 2), rendezvous localhost:{port_for_job(job, step)}" \
        in logs[0], logs[0][-3000:]


class _GroupStarted(Exception):
    """Raised by the fake init_process_group: the test ends where the process group would start."""


@pytest.mark.parametrize("environ, visible, expected", [
    # srun task 3 of 8 on a node that binds one GPU per task (--gpus-per-task=1): LOCAL_RANK 3, one visible device.
    (srun_task(3, 3, 0), 1, {"backend": "nccl", "device_id": "cuda:0", "set_device": 0}),
    # torchrun rank 11 (local rank 3) on a node whose 8 GPUs every rank sees.
    (TORCHRUN, 8, {"backend": "nccl", "device_id": "cuda:3", "set_device": 3}),
    # plain python: a world of one is not bound (DeepSpeed's own rule: no NCCL split without a peer).
    ({}, 1, {"backend": "nccl", "device_id": None, "set_device": 0}),
], ids=["srun-one-gpu-per-task", "torchrun-all-gpus", "single"])
def test_the_process_group_starts_on_the_gpu_the_launcher_chose_not_on_cuda_local_rank(
        environ, visible, expected, tmp_path, monkeypatch):
    """launch/pretrain.py up to the start of the process group, on a CUDA node faked around it: torch refuses a
    device_id out of range (cuda:3 with one visible device), which deepspeed.init_distributed alone would hand it."""
    import torch
    import torch.distributed as dist
    from distsparse.cli import pretrain

    seen = {}

    def init_process_group(backend, **kwargs):
        device = kwargs.get("device_id")
        seen.update(backend=backend, device_id=None if device is None else str(device))
        raise _GroupStarted

    data = make_data_dir(tmp_path / "data")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))
             and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    monkeypatch.setattr(os, "environ", {**clean, **environ})   # what the launch leaves; apply's exports stay here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.update(set_device=index))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(_GroupStarted):
        pretrain.main(["--ds_config", str(ROOT / "configs/ds/zero2.json"), "model.preset=tiny", "data.seq_len=32",
                       f"data.dir={data}", f"train.out_dir={tmp_path / 'run'}"])
    assert seen == expected
