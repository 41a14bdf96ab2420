"""Shared helpers of the project's benchmarks (DESIGN s6): machine description, paired timing, op counts, table,
JSON.

Every benchmark in tools/ computes, prints a table last and, with `--json PATH`, writes the same numbers as
JSON holding `machine` (`machine_info()`, from distsparse/report.py), `config` (every setting that moves the
numbers) and the figures its issue names as top-level keys. The machines are noisy (shared VMs), so comparisons
are paired: both callables run in every round, in alternating order, and the statistic is the median of per-round
ratios. Op counts are the library's (distsparse/op_count.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from distsparse.op_count import count_ops  # noqa: F401  (the tools' API: the library's op counter)
from distsparse.report import add_json_arg, machine_info, print_table, write_json  # noqa: F401  (the tools' API)


def _timed(fn: Callable[[], Any], sync: Callable[[], None] | None) -> float:
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def paired_ratio(fn_a: Callable[[], Any], fn_b: Callable[[], Any], warmup: int, repeats: int,
                 sync: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """(median of t_a / t_b per round, median t_a, median t_b), times in seconds.

    Each round runs both callables back to back, alternating which goes first so that neither always sees
    the other's cache or frequency state; a burst of noise then hits one round's pair, not one side. `sync`
    (e.g. `torch.cuda.synchronize`) is called around every timed call for asynchronous devices.
    """
    if repeats < 1:
        raise ValueError(f"repeats: got {repeats}; allowed: >= 1")
    for _ in range(warmup):
        fn_a()
        fn_b()
    ratios, times_a, times_b = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            t_a = _timed(fn_a, sync)
            t_b = _timed(fn_b, sync)
        else:
            t_b = _timed(fn_b, sync)
            t_a = _timed(fn_a, sync)
        ratios.append(t_a / t_b)
        times_a.append(t_a)
        times_b.append(t_b)
    return statistics.median(ratios), statistics.median(times_a), statistics.median(times_b)


class CpuTimed:
    """A callable that records the process CPU seconds of each of its calls."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.seconds = fn, []

    def __call__(self) -> None:
        t0 = time.process_time()
        self.fn()
        self.seconds.append(time.process_time() - t0)


def paired_cpu_and_wall(fn_a: Callable[[], Any], fn_b: Callable[[], Any], warmup: int, repeats: int,
                        sync: Callable[[], None] | None = None) -> dict[str, float]:
    """`paired_ratio`'s rounds timed on both clocks: "ratio" (median per-round ratio of process CPU seconds),
    "ratios" (the per-round ones), "cpu_a", "cpu_b" (medians) and "wall_ratio", "wall_a", "wall_b". Call i of each side belongs to round i, so the
    CPU ratios pair the same calls as the wall ones. On a shared machine whose load exceeds its cores, a call that
    waits for a core accrues wall time but no CPU time; with one thread CPU time is the call's busy time. (On a GPU
    the CPU clock sees only the host: use the wall figures with `sync`.)"""
    a, b = CpuTimed(fn_a), CpuTimed(fn_b)
    wall_ratio, wall_a, wall_b = paired_ratio(a, b, warmup, repeats, sync)
    cpu_a, cpu_b = a.seconds[warmup:], b.seconds[warmup:]
    per_round = [x / y for x, y in zip(cpu_a, cpu_b)]
    return {"ratio": statistics.median(per_round), "ratios": per_round, "cpu_a": statistics.median(cpu_a),
            "cpu_b": statistics.median(cpu_b), "wall_ratio": wall_ratio, "wall_a": wall_a, "wall_b": wall_b}
