"""Backbone gradients between backward and the update: the bucket layout (one pure function, shared by the matrix
engine and bench/scale_check.py) and the two ways a rank accumulates them over the micro-batches of a step
(`engine.grad_accum_mode`).

    full     An fp32 buffer of W equal shards per bucket on every rank (shard r: rank r's matrices of the bucket,
             padded to the largest). The hooks add every micro-batch's gradients into it; in the last backward a
             complete bucket is reduce-scattered at once (`reduce_scatter_tensor`) and each rank keeps its shard.
             One reduce per step; about W x shard = every gradient, on every rank, whatever W.
    sharded  A persistent fp32 accumulator of the rank's own matrices only. In every backward a bucket's
             gradients go to a transient staging buffer (allocated at its first gradient, sized by
             `bucket_bytes`); the complete bucket is reduce-scattered at once, with uneven segments (segment r:
             rank r's matrices, no padding), and the reduced segment is added into the accumulator when the reduce
             completes, which frees the staging. One reduce is in flight while the next bucket fills. One reduce
             per micro-batch; own gradients (1/W) plus about two buckets of staging per rank.

Both take the mean over ranks of the fp32 sum over micro-batches, dividing by W once at the boundary. With one
micro-batch per step the two modes hold bitwise the same gradients wherever the backend adds each element's W
terms in the same order (always at W = 2); with k micro-batches sharded adds k reduced sums where full reduces one
local sum (fp32 rounding, ~1e-7 relative).

Choosing (`resolve_grad_accum_mode`, engine.grad_accum_mode=auto): with one micro-batch per step both modes send
the same bytes in the same reduces, so sharded (1/W of the persistent gradient bytes) wins outright; with k > 1
micro-batches sharded sends k x the reduce bytes, and is taken where that buys at least 2/3 of the gradient bytes
(W > 2); at W = 2 it would buy half, and full stays. One process (nothing to shard) and replicated mode (every
rank needs every gradient) use full.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distsparse.layers.llama_projections import PROJECTIONS

ALIGN = 128                  # segment / shard length alignment (elements)
GRAD_ACCUM_MODES = ("auto", "full", "sharded")
BUCKET_BYTES = 16 << 20      # sharded mode: fp32 staging bytes of one bucket (a larger matrix is a bucket alone)
MAX_IN_FLIGHT = 1            # sharded mode: reduces still running while the next bucket fills


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def check_grad_accum_mode(mode: str, *, replicated: bool) -> None:
    """The refusals of engine.grad_accum_mode `mode`, for the config at load time and the engine alike."""
    if mode not in GRAD_ACCUM_MODES:
        raise ValueError(f"engine.grad_accum_mode: got {mode!r}; allowed: {', '.join(GRAD_ACCUM_MODES)}")
    if replicated and mode == "sharded":
        raise ValueError("engine.grad_accum_mode: got 'sharded' with engine.mode 'replicated'; allowed: auto or "
                         "full (replicated mode gives every rank every gradient)")


def resolve_grad_accum_mode(mode: str, *, replicated: bool, world_size: int, micro_batches: int) -> str:
    """`full` or `sharded` for engine.grad_accum_mode `mode` (module docstring: the rule behind `auto`)."""
    check_grad_accum_mode(mode, replicated=replicated)
    if replicated:
        return "full"
    if mode != "auto":
        return mode
    if world_size == 1:
        return "full"
    return "sharded" if micro_batches == 1 or world_size > 2 else "full"


# ---- layout (pure) -----------------------------------------------------------------------------------------------

def backward_order(names) -> list[str]:
    """The matrices in the order backward produces their gradients, from their names alone (so every rank and the
    tools derive it whatever order the names come in): deepest layer first, numbers compared as numbers, and
    within a layer LLaMA's projections in reverse forward order (down, up, gate, o, v, k, q); names without a
    known projection come last within their layer, in reverse name order."""
    def key(name: str) -> tuple:   # elements (kind, number, text): comparable across names of any shape
        parts = re.split(r"(\d+)", name)
        prefix = tuple((1, int(p), "") if p.isdigit() else (0, 0, p) for p in parts[:-1])
        leaf = name.rsplit(".", 1)[-1]
        return prefix + ((-1, PROJECTIONS.index(leaf) if leaf in PROJECTIONS else -1, parts[-1]),)
    return sorted(names, key=key, reverse=True)


@dataclass(frozen=True)
class Bucket:
    """Matrices whose gradients are reduced together. `segments[r]`: aligned elements of rank r's matrices in the
    bucket; `offsets[name]`: where the matrix starts in its owner's segment."""
    names: tuple[str, ...]
    segments: tuple[int, ...]
    offsets: dict[str, int]

    @property
    def shard_size(self) -> int:
        """Full mode: every rank's shard padded to the largest segment (reduce_scatter_tensor needs equal ones)."""
        return max(self.segments)

    @property
    def numel(self) -> int:
        """Sharded mode: the staging, segments back to back."""
        return sum(self.segments)

    def segment_start(self, rank: int) -> int:
        return sum(self.segments[:rank])


def _bucket(names: list[str], numel: dict[str, int], owners: dict[str, int], world_size: int) -> Bucket:
    fill, offsets = [0] * world_size, {}
    for name in names:
        offsets[name] = fill[owners[name]]
        fill[owners[name]] += numel[name]
    return Bucket(tuple(names), tuple(align(f) for f in fill), offsets)


def bucket_layout(numel: dict[str, int], owners: dict[str, int], world_size: int, *, num_buckets: int | None = None,
                  bucket_bytes: int | None = None) -> list[Bucket]:
    """The buckets, in backward order (`backward_order`), so a bucket's reduce starts while backward still runs on
    earlier layers and, in sharded mode, about one bucket fills while the one before it reduces. Give one of
    `num_buckets` (full mode: that many buckets of equal matrix count) or `bucket_bytes` (sharded mode: a bucket
    closes before its fp32 staging would pass the cap; a matrix larger than the cap is a bucket alone)."""
    if (num_buckets is None) == (bucket_bytes is None):
        raise ValueError("bucket_layout: give exactly one of num_buckets (full mode) and bucket_bytes (sharded mode)")
    names = backward_order(numel)
    groups: list[list[str]] = []
    if num_buckets is not None:
        if num_buckets < 1:
            raise ValueError(f"engine.num_buckets: got {num_buckets}; allowed: an integer >= 1")
        per = -(-len(names) // num_buckets)
        groups = [names[start:start + per] for start in range(0, len(names), per)]
    else:
        if bucket_bytes < 1:
            raise ValueError(f"engine.bucket_bytes: got {bucket_bytes}; allowed: an integer >= 1")
        fill = [0] * world_size
        for name in names:
            r = owners[name]
            grown = sum(align(f) for f in fill) - align(fill[r]) + align(fill[r] + numel[name])
            if not groups or 4 * grown > bucket_bytes:
                groups.append([])
                fill = [0] * world_size
            groups[-1].append(name)
            fill[r] += numel[name]
    return [_bucket(group, numel, owners, world_size) for group in groups]


def grad_bytes(layout: list[Bucket], rank: int, world_size: int, mode: str, *, micro_batches: int = 1,
               reduce_itemsize: int = 4, wire_copy: bool = False) -> dict[str, int]:
    """Gradient bytes `rank` holds under the engine's rules (a pure count, for tools and tests): `persistent`, held
    between steps, and `transient_peak`, the most that staging buffers, wire copies and reduce outputs hold at once
    during a step whose gradients arrive in layout order. `wire_copy`: the collective's tensors are copies (a
    reduce dtype other than fp32, or a communication device other than the model's)."""
    if mode == "full":
        if world_size == 1:
            return {"persistent": 4 * sum(b.shard_size for b in layout), "transient_peak": 0}
        # Every bucket's reduce output (and wire copy) lives until the boundary waits for them all.
        wires = sum(world_size * b.shard_size * reduce_itemsize for b in layout) if wire_copy else 0
        return {"persistent": 4 * world_size * sum(b.shard_size for b in layout),
                "transient_peak": wires + sum(b.shard_size * reduce_itemsize for b in layout)}
    if mode != "sharded":
        raise ValueError(f"grad_bytes: mode {mode!r}; allowed: full, sharded")
    persistent = 4 * sum(b.segments[rank] for b in layout)
    staging = [4 * b.numel for b in layout]
    if world_size == 1:
        return {"persistent": persistent, "transient_peak": max(staging, default=0)}
    wire = [b.numel * reduce_itemsize if wire_copy else 4 * b.numel for b in layout]   # the staging, unless copied
    out = [b.segments[rank] * reduce_itemsize for b in layout]
    peak = 0
    for i, s in enumerate(staging):
        # bucket i fills while the one before it is in flight (across micro-batches: the step's last one) ...
        before = i - 1 if i else (len(layout) - 1 if micro_batches > 1 else None)
        filling = s + (wire[before] + out[before] if before is not None else 0)
        # ... then launches: its wire (a copy made while the staging lives) and its reduced segment
        launch = max(s + wire[i], wire[i] + out[i]) if wire_copy else wire[i] + out[i]
        peak = max(peak, filling, launch)
    return {"persistent": persistent, "transient_peak": peak}


# ---- runtime -----------------------------------------------------------------------------------------------------

@dataclass
class Comm:
    """Where gradients live and how they travel (DESIGN decision 17: collective tensors on `comm_device`)."""
    group: object
    rank: int
    world_size: int
    collectives: bool             # False with one process (unless forced): nothing is reduced
    device: torch.device          # the model's: buffers, staging, accumulator
    comm_device: torch.device
    reduce_dtype: torch.dtype


class _Transient:
    """Bytes of transient gradient tensors alive now, and the most alive at once since construction."""

    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, t: torch.Tensor) -> torch.Tensor:
        self.now += t.numel() * t.element_size()
        self.peak = max(self.peak, self.now)
        return t

    def free(self, *tensors: torch.Tensor) -> None:
        self.now -= sum(t.numel() * t.element_size() for t in tensors)


def _slots(layout: list[Bucket]) -> Iterator[tuple[str, int, Bucket]]:
    for i, bucket in enumerate(layout):
        for name in bucket.names:
            yield name, i, bucket


class FullBuffer:
    """engine.grad_accum_mode=full, and replicated mode (every rank all-reduces the whole buffer)."""

    def __init__(self, layout: list[Bucket], owners: dict[str, int], numel: dict[str, int], comm: Comm, *,
                 replicated: bool):
        self.layout, self.comm, self.replicated = layout, comm, replicated
        w = comm.world_size
        self.buffers = [torch.zeros(w * b.shard_size, dtype=torch.float32, device=comm.device) for b in layout]
        self._slot = {name: (i, owners[name] * b.shard_size + b.offsets[name], numel[name])
                      for name, i, b in _slots(layout)}
        self._own = [buf[comm.rank * b.shard_size:comm.rank * b.shard_size + b.segments[comm.rank]]
                     for buf, b in zip(self.buffers, layout)]
        self._arrived = [0] * len(layout)
        self._armed = False
        self._pending: list[tuple | None] = [None] * len(layout)   # (handle, wire, out) of a launched bucket
        self.transient = _Transient()

    def add(self, name: str, grad: torch.Tensor) -> None:
        i, start, n = self._slot[name]
        # fp32 accumulation across micro-batches; add_ upcasts a bf16 gradient inside its kernel (no cast launch)
        self.buffers[i][start:start + n].add_(grad.reshape(-1))
        self._arrived[i] += 1
        if self._armed and self._arrived[i] == len(self.layout[i].names):
            self._launch(i)   # overlap: reduce this bucket while backward continues

    def arm(self, last: bool) -> None:
        """Before a backward: `last` (the step's final micro-batch) lets complete buckets reduce from the hooks."""
        self._armed = last
        self._arrived = [0] * len(self.layout)

    def _launch(self, i: int) -> None:
        c = self.comm
        if not c.collectives or self._pending[i] is not None:
            return
        buffer = self.buffers[i]
        wire = buffer.to(c.comm_device, c.reduce_dtype)   # the buffer itself when fp32 on the comm device
        if wire is not buffer:
            self.transient.alloc(wire)
        if self.replicated:
            out = None
            handle = dist.all_reduce(wire, group=c.group, async_op=True)
        else:
            out = self.transient.alloc(torch.empty(self.layout[i].shard_size, dtype=c.reduce_dtype,
                                                   device=c.comm_device))
            handle = dist.reduce_scatter_tensor(out, wire, group=c.group, async_op=True)
        self._pending[i] = (handle, wire, out)

    def reduce(self) -> None:
        """Mean over ranks: owners receive their shard, or everyone the whole buffer (replicated). Buckets already
        launched from the hooks are only waited for."""
        self._armed = False
        c = self.comm
        if not c.collectives:
            return
        for i in range(len(self.layout)):
            self._launch(i)
        for i, (buffer, bucket) in enumerate(zip(self.buffers, self.layout)):
            handle, wire, out = self._pending[i]
            handle.wait()
            if self.replicated:
                buffer.copy_(wire)
            else:
                start = c.rank * bucket.shard_size
                buffer[start:start + bucket.shard_size].copy_(out)
            buffer.div_(c.world_size)
            self.transient.free(*(t for t in (out, wire) if t is not None and t is not buffer))
            self._pending[i] = None

    def grad(self, name: str) -> torch.Tensor:
        i, start, n = self._slot[name]
        return self.buffers[i][start:start + n]

    def own(self) -> list[torch.Tensor]:
        """This rank's own part of every bucket (its matrices' reduced gradients, zero padding after them)."""
        return self._own

    def zero(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()

    def persistent(self) -> list[torch.Tensor]:
        return self.buffers

    def reduce_bytes_per_step(self, micro_batches: int) -> float:
        """Bytes this rank sends in the step's reduces (ring model: a reduce-scatter sends W-1 shards, an
        all-reduce 2 (W-1)/W of its buffer). One reduce per step, however many micro-batches."""
        w, itemsize = self.comm.world_size, self.comm.reduce_dtype.itemsize
        shards = sum(b.shard_size for b in self.layout)
        if self.replicated:
            return 2 * (w - 1) / w * w * shards * itemsize
        return float((w - 1) * shards * itemsize)


class ShardedAccumulator:
    """engine.grad_accum_mode=sharded: reduce every micro-batch's buckets into an accumulator of own gradients."""

    def __init__(self, layout: list[Bucket], owners: dict[str, int], numel: dict[str, int], comm: Comm):
        self.layout, self.comm = layout, comm
        r = comm.rank
        starts, total = [], 0
        for b in layout:
            starts.append(total)
            total += b.segments[r]
        self.acc = torch.zeros(total, dtype=torch.float32, device=comm.device)
        self._own_segments = [self.acc[s:s + b.segments[r]] for s, b in zip(starts, layout)]
        self._slot = {name: (i, b.segment_start(owners[name]) + b.offsets[name], numel[name])
                      for name, i, b in _slots(layout)}
        self._acc_slot = {name: starts[i] + b.offsets[name] for name, i, b in _slots(layout) if owners[name] == r}
        self._staging: list[torch.Tensor | None] = [None] * len(layout)
        self._arrived = [0] * len(layout)
        self._in_flight: deque = deque()   # (bucket, handle, wire, out)
        self.transient = _Transient()

    def add(self, name: str, grad: torch.Tensor) -> None:
        i, start, n = self._slot[name]
        if self._staging[i] is None:
            self._staging[i] = self.transient.alloc(
                torch.zeros(self.layout[i].numel, dtype=torch.float32, device=self.comm.device))
        self._staging[i][start:start + n].add_(grad.reshape(-1))   # upcast inside add_, as above
        self._arrived[i] += 1
        if self._arrived[i] == len(self.layout[i].names):
            self._launch(i)   # every micro-batch: reduce this bucket while backward continues

    def arm(self, last: bool) -> None:
        """Every backward reduces its buckets as they complete: nothing to arm."""

    def _launch(self, i: int) -> None:
        c, bucket = self.comm, self.layout[i]
        staging, self._staging[i], self._arrived[i] = self._staging[i], None, 0
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._retire()
        if not c.collectives:
            seg = bucket.segment_start(c.rank)
            self._own_segments[i].add_(staging[seg:seg + bucket.segments[c.rank]])
            self.transient.free(staging)
            return
        wire = staging.to(c.comm_device, c.reduce_dtype)   # the staging itself when fp32 on the comm device
        if wire is not staging:
            self.transient.alloc(wire)
            self.transient.free(staging)
        out = self.transient.alloc(torch.empty(bucket.segments[c.rank], dtype=c.reduce_dtype, device=c.comm_device))
        if len(set(bucket.segments)) == 1:
            handle = dist.reduce_scatter_tensor(out, wire, group=c.group, async_op=True)
        else:   # uneven segments: NCCL runs it as one coalesced reduce per rank
            handle = dist.reduce_scatter(out, list(wire.split(bucket.segments)), group=c.group, async_op=True)
        self._in_flight.append((i, handle, wire, out))

    def _retire(self, keep: bool = True) -> None:
        i, handle, wire, out = self._in_flight.popleft()
        handle.wait()
        if keep:
            self._own_segments[i].add_(out.to(self.comm.device))   # fp32 sum over micro-batches
        self.transient.free(wire, out)

    def reduce(self) -> None:
        """Mean over ranks of the sum over micro-batches, in the accumulator. A bucket still filling (some matrix
        had no gradient) is reduced now, on every rank alike."""
        for i, staging in enumerate(self._staging):
            if staging is not None:
                self._launch(i)
        while self._in_flight:
            self._retire()
        if self.comm.collectives:
            self.acc.div_(self.comm.world_size)

    def grad(self, name: str) -> torch.Tensor:
        start = self._acc_slot.get(name)
        if start is None:
            raise KeyError(f"{name!r}: rank {self.comm.rank} holds the gradients of its own matrices only "
                           f"(engine.grad_accum_mode=sharded)")
        return self.acc[start:start + self._slot[name][2]]

    def own(self) -> list[torch.Tensor]:
        return [self.acc]

    def zero(self) -> None:
        """Zero the accumulator; a reduce still running is waited for and a bucket still filling is dropped, on
        every rank alike, so nothing reaches the next step."""
        while self._in_flight:
            self._retire(keep=False)
        for staging in self._staging:
            if staging is not None:
                self.transient.free(staging)
        self._staging, self._arrived = [None] * len(self.layout), [0] * len(self.layout)
        self.acc.zero_()

    def persistent(self) -> list[torch.Tensor]:
        return [self.acc]

    def reduce_bytes_per_step(self, micro_batches: int) -> float:
        """Bytes this rank sends in the step's reduces: every segment but its own, per bucket and micro-batch
        (ring reduce-scatter; NCCL's uneven form, one reduce per rank, sends the same)."""
        if self.comm.world_size == 1:
            return 0.0
        other = sum(b.numel - b.segments[self.comm.rank] for b in self.layout)
        return float(micro_batches * other * self.comm.reduce_dtype.itemsize)
