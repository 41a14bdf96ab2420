"""An H200 roofline of one training step from its op trace (issue 25 item 5). A yardstick, not a promise: when a GPU
is lent, its error against the measured step is reported beside it.

Model (per rank; the step ends when the slowest rank's does):
    op time          = max(LAUNCH_FLOOR_S, flops / peak, bytes / HBM_BPS)     for every op that launches
    peak             = BF16_PEAK_FLOPS, or FP32_PEAK_FLOPS for a FLOP-counted op on float32 inputs: torch leaves
                       TF32 off for matmuls by default, so an fp32 matmul runs on the CUDA cores (67 TFLOP/s)
    views, allocs    0 s (they alias or allocate; no kernel)
    collective time  = max(LAUNCH_FLOOR_S, ring_factor x bytes / link), bytes of the full buffer:
                       ring_factor 2 (W-1)/W for all_reduce, (W-1)/W for reduce_scatter, all_gather and broadcast
                       (each rank sends W-1 shards; NCCL's bus-bandwidth model); link NVLINK_BPS per direction
                       within a node of GPUS_PER_NODE, INTER_NODE_BPS (400 Gb/s) once the ring leaves the node
    step             = sum of op times + sum of collective times: nothing overlaps (no compute/communication
                       overlap, no host running ahead hidden by a launch queue), so it errs long, and
                       equally for every row.
Constants: H200 SXM data sheet (989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 4.8 TB/s HBM3e, NVLink 900 GB/s
bidirectional), a 5 us launch floor (issue 25's 5-10 us per kernel, the low end).
"""

from __future__ import annotations

from collections.abc import Iterable

from distsparse.perf.trace import CollectiveRecord, OpRecord

LAUNCH_FLOOR_S = 5e-6
BF16_PEAK_FLOPS = 989e12
FP32_PEAK_FLOPS = 67e12
HBM_BPS = 4.8e12
NVLINK_BPS = 450e9
INTER_NODE_BPS = 50e9
GPUS_PER_NODE = 8
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def op_seconds(op: OpRecord) -> float:
    """One op's time (module docstring)."""
    if op.view or op.alloc:
        return 0.0
    peak = FP32_PEAK_FLOPS if op.fp32_matmul else BF16_PEAK_FLOPS
    return max(LAUNCH_FLOOR_S, op.flops / peak, op.bytes / HBM_BPS)


def ring_factor(kind: str, world_size: int) -> float:
    if kind not in COLLECTIVES:
        raise ValueError(f"collective kind: got {kind!r}; allowed: {', '.join(COLLECTIVES)}")
    w = world_size
    return 2 * (w - 1) / w if kind == "all_reduce" else (w - 1) / w


def collective_seconds(c: CollectiveRecord, world_size: int, gpus_per_node: int = GPUS_PER_NODE) -> float:
    """One collective's time on `world_size` GPUs (0 on one: nothing is sent)."""
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError(f"world_size, gpus_per_node: got {world_size}, {gpus_per_node}; allowed: >= 1")
    if world_size == 1:
        return 0.0
    link = NVLINK_BPS if world_size <= gpus_per_node else INTER_NODE_BPS
    return max(LAUNCH_FLOOR_S, ring_factor(c.kind, world_size) * c.bytes / link)


def estimate(ops: Iterable[OpRecord], collectives: Iterable[CollectiveRecord], world_size: int,
             gpus_per_node: int = GPUS_PER_NODE) -> dict[str, float]:
    """Seconds of a traced piece of a step, split by what bounds each op, with its totals."""
    out = {"launch_bound_s": 0.0, "flop_bound_s": 0.0, "byte_bound_s": 0.0, "collective_s": 0.0,
           "launches": 0, "flops": 0.0, "bytes": 0}
    for op in ops:
        t = op_seconds(op)
        if t == 0.0:
            continue
        out["launches"] += 1
        out["flops"] += op.flops
        out["bytes"] += op.bytes
        peak = FP32_PEAK_FLOPS if op.fp32_matmul else BF16_PEAK_FLOPS
        bound = ("launch_bound_s" if t == LAUNCH_FLOOR_S else
                 "flop_bound_s" if t == op.flops / peak else "byte_bound_s")
        out[bound] += t
    out["collective_s"] = sum(collective_seconds(c, world_size, gpus_per_node) for c in collectives)
    out["total_s"] = out["launch_bound_s"] + out["flop_bound_s"] + out["byte_bound_s"] + out["collective_s"]
    return out
