"""The one way to start ranks: persistent worker processes, one per rank, that run functions on every rank.

Starting a rank (torch, DeepSpeed and transformers imports, process group) costs seconds, so a pool starts its
ranks once and runs many functions: `pool.run(fn, *args)` runs fn(rank, world_size, *args) on every rank and returns
the per-rank results in rank order. The test suite shares one 2-rank pool for the session (tests/conftest.py); a
benchmark's own run starts a pool for its ranks (`with RankPool(n) as pool:`). On CPU the ranks use gloo with one
OpenMP thread each (DESIGN s6: ranks x threads <= cores); with `cuda`, NCCL with one GPU per rank.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from distsparse.cli.launch_env import free_port

TIMEOUT_S = 600


def _worker(rank: int, world_size: int, port: int, cuda: bool, tasks, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", DS_ACCELERATOR="cuda" if cuda else "cpu")
    import torch
    import torch.distributed as dist
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # report everything: the pool must survive a failing function
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int = 2, cuda: bool = False):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, cuda, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(rank, world_size, *args) on every rank (a module-level function); raises with the failing ranks'
        tracebacks."""
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"rank pool: no answer within {TIMEOUT_S}s (a rank hung or died)") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def on_ranks(pool: RankPool | None, world_size: int, fn: Callable[..., Any], *args: Any, cuda: bool = False
             ) -> list[Any]:
    """fn on the ranks of `pool` (the test suite's) or, without one, of a fresh pool of `world_size` ranks."""
    if pool is not None:
        assert pool.world_size == world_size, (pool.world_size, world_size)
        return pool.run(fn, *args)
    with RankPool(world_size, cuda=cuda) as own:
        return own.run(fn, *args)
