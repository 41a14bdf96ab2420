"""The shared multi-rank fixture: persistent gloo worker processes that run test bodies on every rank.

Starting a rank (torch, DeepSpeed and transformers imports, process group) costs seconds, so the ranks start
once per session and run many test functions. A test passes a module-level function; it runs on every rank
as fn(rank, world_size, *args) and the per-rank return values come back as a list.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

TIMEOUT_S = 600


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # report everything, the pool must survive a failing test
            results.put((rank, False, traceback.format_exc()))


class RankPool:
    def __init__(self, world_size: int = 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args) -> list:
        """fn(rank, world_size, *args) on every rank; raises with the rank's traceback if one fails."""
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
            p.join(timeout=2)
            if p.is_alive():
                p.kill()


TOOLS = str(Path(__file__).resolve().parents[1] / "tools")


def import_tool(module: str):
    """tools/<module>.py as a module (the tools are scripts, not a package: their folder goes on sys.path)."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    return importlib.import_module(module)


def _tool_rank(rank: int, world_size: int, module: str, fn_name: str, *args):
    # Pool workers started before the test imported the tool: import it here too.
    return getattr(import_tool(module), fn_name)(rank, world_size, *args)


def tool_runner(pool: RankPool, module: str):
    """A `runner(fn, world_size, *args)` for tools/<module>.py's main() that runs fn on the pool's ranks."""
    def runner(fn, world_size: int, *args) -> list:
        assert world_size == pool.world_size
        return pool.run(_tool_rank, module, fn.__name__, *args)
    return runner
