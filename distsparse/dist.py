"""Scalar agreement between ranks: the few named collectives used outside the matrix engine, and the one place that
names the device collective tensors live on (DESIGN decision 17).

Every helper is a no-op with one process, so single-process code paths are the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def backend_device(backend: str) -> torch.device:
    """Where a backend's collectives take their tensors: NCCL only moves CUDA tensors (the device the launcher set
    for this process), gloo is used here for CPU tensors. A combined backend string ("cpu:gloo,cuda:nccl") counts
    as NCCL, so the hot path stays on the GPU."""
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_device(group=None) -> torch.device:
    """The device of every tensor handed to a collective of `group`: the one helper that names it."""
    if not is_initialized():
        return torch.device("cpu")
    return backend_device(str(dist.get_backend(group)))


def dist_sum(value: torch.Tensor | float, group=None) -> torch.Tensor:
    """Sum of a scalar or tensor over ranks: a new tensor on the caller's device (float64 on the CPU for Python
    scalars). The input is never modified."""
    if isinstance(value, torch.Tensor):
        home, t = value.device, value.detach().to(comm_device(group), copy=True)
    else:
        home, t = torch.device("cpu"), torch.tensor(float(value), dtype=torch.float64, device=comm_device(group))
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.to(home)


def dist_max(value: float, group=None) -> float:
    t = torch.tensor(float(value), dtype=torch.float64, device=comm_device(group))
    if is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def any_rank(flag: bool, group=None) -> bool:
    """True on every rank when `flag` is true on at least one (e.g. a preemption signal seen by one rank)."""
    return dist_max(1.0 if flag else 0.0, group) > 0


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def new_group():
    """A dedicated process group on the default group's backend (the matrix engine's traffic stays out of
    DeepSpeed's)."""
    return dist.new_group(backend=dist.get_backend()) if is_initialized() else None


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order (small metadata only: file names and checksums). torch pickles
    through a tensor on the backend's device itself (the current CUDA device under NCCL)."""
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
