"""The preparation's worker pool: spawn processes that end when the launcher does.

A `kill -9` of the launcher alone (not of its process group) would otherwise leave its workers orphaned
(PPID 1), still writing `.partial` shards while a restarted preparation writes the same ones. Each worker
waits, on a daemon thread, for its parent's sentinel (readable once the parent is gone, however it ended) and
then exits at once; no cleanup is needed, as a restart rewrites every unfinished part from its start."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.pool
import os
import threading

PARENT_GONE_EXIT = 3   # the exit status of a worker whose launcher died


def exit_with_parent() -> None:
    """Pool initializer: start the watch on the parent's sentinel."""
    parent = multiprocessing.parent_process()
    assert parent is not None, "exit_with_parent runs in a child process"
    threading.Thread(target=_wait_then_exit, args=(parent.sentinel,), name="exit-with-parent", daemon=True).start()


def _wait_then_exit(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(PARENT_GONE_EXIT)   # not sys.exit: the main thread may be inside a tokenizer call


def worker_pool(num_proc: int) -> multiprocessing.pool.Pool:
    """`num_proc` spawn workers (they import only numpy, the readers and the tokenizer) that exit with this
    process."""
    return multiprocessing.get_context("spawn").Pool(num_proc, initializer=exit_with_parent)
