"""Where a training process sits in its job: one record resolved from the launcher's environment
(DESIGN decision 17). Nothing else in the project reads RANK, SLURM_* or chooses the GPU.

What each launcher leaves in the environment, in the order it is recognised:

    RANK set             deepspeed launcher (LOCAL_SIZE, CROSS_RANK), torchrun (LOCAL_WORLD_SIZE,
                         TORCHELASTIC_RUN_ID), a submitit job after TorchDistributedEnvironment().export()
                         (SUBMITIT_EXECUTOR): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    one of srun's tasks  SLURM_PROCID, SLURM_STEP_NUM_TASKS (srun sets it for every task it starts),
                         SLURM_LOCALID, SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST,
                         SLURM_JOB_ID, SLURM_STEP_ID; MASTER_ADDR is the step's first host and MASTER_PORT a
                         function of the job and step ids, unless the job exported either itself
    nothing              plain `python`: a world of one on a free local port

A multi-task launch that none of these describes is refused with a message that says how to launch, never run
as N worlds of one: WORLD_SIZE > 1 without RANK, a SLURM allocation of several tasks seen from outside an srun
step (the batch script, an salloc shell), or an MPI launch that sets only its own rank variables (`mpirun -np 8`,
`deepspeed --launcher openmpi`: OMPI_COMM_WORLD_SIZE, PMI_SIZE or MV2_COMM_WORLD_SIZE > 1 without RANK).

`resolve` is a pure function of an environ mapping (the node-list expander and the free-port finder are
arguments) and `LaunchEnv.device_index` of a device count, so every case is tested on CPU with fake
environments; `apply` (exports the variables DeepSpeed reads, sets the GPU) and `start` (apply, then the default
process group on that GPU) are the functions with effects. Every entry point calls `start`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from itertools import product

# World sizes MPI launchers set (Open MPI, MPICH / Intel MPI's PMI, MVAPICH2) without RANK: refused, not read.
MPI_WORLD_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")

# MASTER_PORT of an srun launch: every task of the step computes the same port without talking to the others.
PORT_MIN, PORT_SPAN = 20000, 40000

HOW_TO_LAUNCH = ("launch one process per GPU with `deepspeed launch/pretrain.py ...` (hostfile for several "
                 "nodes), `torchrun --nproc-per-node G launch/pretrain.py ...`, `srun --ntasks-per-node G python "
                 "launch/pretrain.py ...` inside an allocation, or `python launch/slurm.py ...` to submit; plain "
                 "`python launch/pretrain.py` is a world of one (README: Launching on GPU clusters)")


class LaunchError(ValueError):
    """The environment describes no launch this project can run; the message says how to launch."""


@dataclass(frozen=True)
class LaunchEnv:
    source: str                    # deepspeed | torchrun | submitit | env | srun | single
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None   # None where the launcher does not say
    master_addr: str
    master_port: int

    def device_index(self, device_count: int) -> int:
        """The CUDA device of this process: LOCAL_RANK modulo the visible devices. One rank per GPU when every
        task sees all of the node's GPUs (index = local rank) and when SLURM binds one GPU per task (each task
        sees one device: index 0)."""
        if device_count < 1:
            raise ValueError(f"device_count: got {device_count}; allowed: >= 1 (no CUDA device: run on CPU)")
        return self.local_rank % device_count

    def exports(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous (and DeepSpeed's init_distributed) read."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if self.local_world_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return out


def _int(environ: Mapping[str, str], name: str, low: int = 0) -> int:
    text = environ[name]
    try:
        value = int(text)
    except ValueError:
        raise LaunchError(f"{name}: got {text!r}; allowed: an integer >= {low}") from None
    if value < low:
        raise LaunchError(f"{name}: got {value}; allowed: an integer >= {low}")
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- SLURM node lists ---------------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: 'a[1-2,4],b' -> ['a[1-2,4]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth < 0:
            raise LaunchError(f"node list: got {text!r}; unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"node list: got {text!r}; unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_brackets(ranges: str, nodelist: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (zero padding kept, as SLURM's hostlist does)."""
    out = []
    for item in ranges.split(","):
        m = _RANGE.match(item)
        if not m:
            raise LaunchError(f"node list: got {nodelist!r}; {item!r} is not N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise LaunchError(f"node list: got {nodelist!r}; range {item!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list -> host names: 'gpu[01-02,05],login1' -> gpu01, gpu02, gpu05, login1;
    several bracket groups in one name expand as a product ('r[1-2]n[1-2]' -> r1n1, r1n2, r2n1, r2n2)."""
    hosts: list[str] = []
    for part in _split_top(nodelist.strip()):
        pieces = re.split(r"\[([^\]]*)\]", part)   # text, ranges, text, ranges, ..., text
        choices = [[pieces[i]] if i % 2 == 0 else _expand_brackets(pieces[i], nodelist) for i in range(len(pieces))]
        hosts.extend("".join(combo) for combo in product(*choices))
    if not hosts:
        raise LaunchError(f"node list: got {nodelist!r}; no host in it")
    return hosts


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames` where SLURM's client is installed (it knows every form), else the parser."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=60)
        hosts = out.stdout.split()
        if out.returncode == 0 and hosts:
            return hosts
    return expand_nodelist(nodelist)


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM's tasks-per-node form ('2(x3),1': three nodes of 2 tasks, then one of 1) -> tasks on node `node_id`."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item.strip())
        if not m:
            raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE: got {tasks_per_node!r}; expected forms like 2(x3),1")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    if not 0 <= node_id < len(counts):
        raise LaunchError(f"SLURM_NODEID: got {node_id}; the step's tasks-per-node {tasks_per_node!r} lists "
                          f"{len(counts)} nodes")
    return counts[node_id]


def port_for_job(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port of an srun step: the same on every task, different for the steps of one job."""
    return PORT_MIN + (job_id * 100 + step_id) % PORT_SPAN


# ---- resolution -----------------------------------------------------------------------------------------------

def _from_rank_vars(environ: Mapping[str, str]) -> LaunchEnv:
    if "WORLD_SIZE" not in environ:
        raise LaunchError(f"RANK is set ({environ['RANK']!r}) but WORLD_SIZE is not; {HOW_TO_LAUNCH}")
    world = _int(environ, "WORLD_SIZE", 1)
    rank = _int(environ, "RANK")
    if rank >= world:
        raise LaunchError(f"RANK: got {rank} with WORLD_SIZE {world}; allowed: 0 .. {world - 1}")
    if "TORCHELASTIC_RUN_ID" in environ:
        source, local_size_var = "torchrun", "LOCAL_WORLD_SIZE"
    elif "CROSS_RANK" in environ or "LOCAL_SIZE" in environ:
        source, local_size_var = "deepspeed", "LOCAL_SIZE"
    elif "SUBMITIT_EXECUTOR" in environ:
        source, local_size_var = "submitit", "LOCAL_WORLD_SIZE"
    else:
        source, local_size_var = "env", "LOCAL_WORLD_SIZE"
    local_world = _int(environ, local_size_var, 1) if local_size_var in environ else None
    if "LOCAL_RANK" in environ:
        local_rank = _int(environ, "LOCAL_RANK")
    elif world == 1:
        local_rank = 0
    else:
        raise LaunchError(f"LOCAL_RANK is not set in a world of {world} (RANK {rank}); it chooses the GPU. "
                          f"{HOW_TO_LAUNCH}")
    if local_world is not None and local_rank >= local_world:
        raise LaunchError(f"LOCAL_RANK: got {local_rank} with {local_size_var} {local_world}; "
                          f"allowed: 0 .. {local_world - 1}")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if missing and world > 1:
        raise LaunchError(f"{' and '.join(missing)} not set in a world of {world}: the ranks cannot meet. "
                          f"{HOW_TO_LAUNCH}")
    addr = environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int(environ, "MASTER_PORT", 1) if "MASTER_PORT" in environ else 0
    return LaunchEnv(source, rank, world, local_rank, local_world, addr, port)


def _from_srun(environ: Mapping[str, str], hostnames: Callable[[str], list[str]],
               find_port: Callable[[], int]) -> LaunchEnv:
    world = _int(environ, "SLURM_STEP_NUM_TASKS", 1)
    rank = _int(environ, "SLURM_PROCID")
    if rank >= world:
        raise LaunchError(f"SLURM_PROCID: got {rank} with SLURM_STEP_NUM_TASKS {world}; allowed: 0 .. {world - 1}")
    local_rank = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node_id = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    local_world = tasks_on_node(per_node, node_id) if per_node else None
    if world == 1:
        return LaunchEnv("srun", 0, 1, local_rank, local_world, "127.0.0.1", find_port())
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    else:
        nodelist = next((environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if environ.get(k)), None)
        if nodelist is None:
            raise LaunchError(f"srun task {rank} of {world}: no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to find "
                              f"rank 0's host (or set MASTER_ADDR); {HOW_TO_LAUNCH}")
        addr = hostnames(nodelist)[0]
    if "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT", 1)
    elif "SLURM_JOB_ID" in environ:
        step = _int(environ, "SLURM_STEP_ID") if "SLURM_STEP_ID" in environ else 0
        port = port_for_job(_int(environ, "SLURM_JOB_ID"), step)
    else:
        raise LaunchError(f"srun task {rank} of {world}: no SLURM_JOB_ID to derive the rendezvous port from "
                          f"(or set MASTER_PORT); {HOW_TO_LAUNCH}")
    return LaunchEnv("srun", rank, world, local_rank, local_world, addr, port)


def resolve(environ: Mapping[str, str], hostnames: Callable[[str], list[str]] = expand_nodelist,
            find_port: Callable[[], int] = free_port) -> LaunchEnv:
    """The launch this environment describes (module docstring); LaunchError for one it does not describe."""
    if "RANK" in environ:
        env = _from_rank_vars(environ)
        return env if env.master_port else replace(env, master_port=find_port())   # a world of one
    if "WORLD_SIZE" in environ and environ["WORLD_SIZE"].strip() not in ("", "1"):
        raise LaunchError(f"WORLD_SIZE is {environ['WORLD_SIZE']!r} but RANK is not set: this process does not "
                          f"know its rank. {HOW_TO_LAUNCH}")
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        return _from_srun(environ, hostnames, find_port)
    for name in MPI_WORLD_SIZES:
        if environ.get(name, "").strip() not in ("", "1"):
            raise LaunchError(f"{name} is {environ[name]!r} but RANK is not set: an MPI launch (mpirun, deepspeed "
                              f"--launcher openmpi) is not read here, each process would train alone. "
                              f"{HOW_TO_LAUNCH}")
    tasks = environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS")
    if tasks and tasks.strip() != "1":
        raise LaunchError(f"SLURM_NTASKS is {tasks!r} but this process is not one of srun's tasks (no "
                          f"SLURM_STEP_NUM_TASKS): run from an sbatch script or an salloc shell, it would train "
                          f"alone. {HOW_TO_LAUNCH}")
    return LaunchEnv("single", 0, 1, 0, 1, "127.0.0.1", find_port())


def resolve_here() -> LaunchEnv:
    """`resolve` of this process's environment, node lists expanded by `scontrol` where it is installed."""
    return resolve(os.environ, hostnames=scontrol_hostnames)


def apply(env: LaunchEnv) -> int | None:
    """Export the record's variables (DeepSpeed's init_distributed and torch's env:// rendezvous read them) and,
    with CUDA, select this process's GPU before any process group starts. Returns the device index (None on
    CPU)."""
    import torch

    os.environ.update(env.exports())
    if not torch.cuda.is_available():
        return None
    index = env.device_index(torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


def describe(env: LaunchEnv, device: int | None) -> str:
    """One log line: who launched this process and where it trains."""
    where = f"cuda:{device}" if device is not None else "cpu"
    return (f"launch: {env.source}, rank {env.rank} of world {env.world_size} (local rank {env.local_rank}"
            f"{'' if env.local_world_size is None else f' of {env.local_world_size}'}), rendezvous "
            f"{env.master_addr}:{env.master_port}, device {where}")


def start(env: LaunchEnv) -> int | None:
    """`apply`, then the default process group, before any model exists: NCCL on this process's GPU with CUDA, gloo
    without; DeepSpeed adopts it. Returns the device index (None on CPU).

    With several ranks the NCCL group is bound to the GPU `device_index` chose. deepspeed.init_distributed alone
    binds cuda:LOCAL_RANK (deepspeed/comm/torch.py, `init_process_group`), which torch refuses as out of range where
    SLURM gives each task one GPU (LOCAL_RANK 3, one visible device). A world of one is not bound, as DeepSpeed
    does not bind it: binding makes every later new_group an NCCL split with no peer."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.constants import default_pg_timeout

    device = apply(env)
    backend = "gloo" if device is None else "nccl"
    if not dist.is_initialized():
        bind = {"device_id": torch.device("cuda", device)} if device is not None and env.world_size > 1 else {}
        dist.init_process_group(backend, timeout=default_pg_timeout, **bind)
    deepspeed.init_distributed(dist_backend=backend)
    return device
