"""An op trace of a piece of code: per aten op its FLOPs and the bytes it reads and writes, and per collective its
kind and buffer bytes (issue 25 item 5; the input of distsparse/perf/roofline.py).

`OpTracer` extends distsparse/op_count.py's `OpCounter` (the same ops, views and syncs counted) with one
`OpRecord` per op:
  flops   as torch.utils.flop_counter counts them: `flop_registry[op](*args, out_val=out)` for the ops it knows
          (mm, addmm, bmm, baddbmm, convolution, scaled-dot-product attention), 0 for every other op
  bytes   sum of numel x itemsize over the tensor inputs (lists included) and tensor outputs; an in-place op reads
          and writes its destination, so it counts twice (an op that returns nothing, `_foreach_add_` or
          `_fused_adamw_`, counts its mutated arguments, the schema's write aliases, as written). Views alias and move nothing: 0 bytes, `view=True`.
          `_unsafe_view` (reshape's alias of a fresh tensor) is one too, though torch does not mark it `is_view`.
          Tensors that only allocate (empty, empty_like, empty_strided) move nothing either (`alloc=True`)
  fp32_matmul  a FLOP-counted op whose first tensor input is float32 (the roofline charges it another peak)
Shapes are all it needs, so it runs as well on the meta device (nothing computed) as on the CPU.

Collectives are recorded by `simulated_world` (not from the dispatch): it stands in for torch.distributed's
group queries and collectives with a world of `world_size` ranks seen from `rank`, records each collective as a
`CollectiveRecord` (kind, bytes of its full buffer: the output of an all-gather, the input of a reduce-scatter,
the tensor of an all-reduce or broadcast) and returns without communicating (outputs keep their values: on meta
there are none). Code that reads `torch.distributed.*` at call time (the matrix engine, grad_buckets, dist.py)
then lays itself out for that world from its own layout functions, with no process group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils.flop_counter import flop_registry
from torch.utils._pytree import tree_leaves

from distsparse import dist as ddist
from distsparse.op_count import OpCounter

ALIAS_OPS = frozenset({"_unsafe_view"})
ALLOC_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


@dataclass(frozen=True)
class OpRecord:
    name: str              # "aten.mm.default"
    flops: float
    bytes: int
    fp32_matmul: bool = False
    view: bool = False
    alloc: bool = False


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str              # all_reduce | reduce_scatter | all_gather | broadcast
    bytes: int             # of the full buffer (module docstring)


def tensor_bytes(tree) -> int:
    """Bytes of every tensor leaf of a (nested) argument tree."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _first_tensor(tree) -> torch.Tensor | None:
    return next((t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)), None)


def _mutated_bytes(func, args, kwargs) -> int:
    """Bytes of the arguments the op's schema marks as written (in-place ops that return nothing)."""
    total = 0
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            total += tensor_bytes(value)
    return total


class OpTracer(OpCounter):
    """OpCounter that also keeps one OpRecord per op in `records` (module docstring)."""

    def __init__(self):
        super().__init__()
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name, packet = str(func), func.overloadpacket
        if func.is_view or packet.__name__ in ALIAS_OPS:
            self.records.append(OpRecord(name, 0.0, 0, view=True))
        elif packet.__name__ in ALLOC_OPS:
            self.records.append(OpRecord(name, 0.0, 0, alloc=True))
        else:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
            first = _first_tensor(args)
            fp32 = flops > 0 and first is not None and first.dtype == torch.float32
            written = tensor_bytes(out) if _first_tensor(out) is not None else _mutated_bytes(func, args, kwargs)
            self.records.append(OpRecord(name, flops, tensor_bytes((args, kwargs)) + written, fp32))
        return out


class _Work:
    def wait(self) -> bool:
        return True


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int, log: list[CollectiveRecord], device: torch.device | str = "meta"):
    """torch.distributed as seen from `rank` of a `world_size` world, collectives recorded into `log`; the
    collectives' device (distsparse.dist.comm_device) is `device`, as NCCL's is the model's GPU."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: got {rank} with world_size {world_size}; allowed: 0 .. {world_size - 1}")

    def record(kind: str, buffer, async_op: bool):
        log.append(CollectiveRecord(kind, tensor_bytes(buffer)))
        return _Work() if async_op else None

    patches = {
        "is_initialized": lambda: True,
        "get_world_size": lambda group=None: world_size,
        "get_rank": lambda group=None: rank,
        "get_backend": lambda group=None: "nccl",
        "new_group": lambda *a, **k: object(),
        "barrier": lambda *a, **k: None,
        "all_reduce": lambda t, *a, async_op=False, **k: record("all_reduce", t, async_op),
        "broadcast": lambda t, *a, async_op=False, **k: record("broadcast", t, async_op),
        "reduce_scatter_tensor": lambda out, inp, *a, async_op=False, **k: record("reduce_scatter", inp, async_op),
        "reduce_scatter": lambda out, inputs, *a, async_op=False, **k: record("reduce_scatter", inputs, async_op),
        "all_gather_into_tensor": lambda out, inp, *a, async_op=False, **k: record("all_gather", out, async_op),
    }
    with contextlib.ExitStack() as stack:
        for attr, fn in patches.items():
            stack.enter_context(mock.patch.object(dist, attr, fn))
        stack.enter_context(mock.patch.object(ddist, "comm_device", lambda group=None: torch.device(device)))
        yield log
