"""Counting what a piece of code asks of the device, the same on every device (DESIGN decision 21, issue 25).

On a GPU every aten operation that computes is at least one kernel launch (5-10 us of host time) and a host sync
stalls the host until the device drains, so "ops per step" and "syncs per step" predict the launch-bound part of a
step before any GPU is at hand. `OpCounter` is a TorchDispatchMode: it sees every aten op below autograd and the
composite decompositions, exactly as the backend will be asked to run them, whatever the device.

    with OpCounter() as counter:
        engine.step(lr)
    counter.counts.ops, counter.counts.views, counter.counts.syncs

What it counts:
  ops     every aten op dispatched, views included (a view launches nothing, but costs host dispatch time; issue
          25's figures count them: TANS ~105 ops per matrix per step, AdamW 31). `views` says how many of them
          only alias their input (`OpOverload.is_view`), so `ops - views` is an upper bound on kernel launches.
  syncs   ops that make the host wait for the device: a scalar read (`aten._local_scalar_dense`: `.item()`,
          `int(t)`, `bool(t)`, `if t:`), ops whose output size depends on the data (`nonzero`, `masked_select`,
          `unique`, ...) and `equal` (its answer is a host bool), and copies from a non-CPU tensor into a CPU one.
          Counted on any device, so a CPU test fails where a GPU run would stall. Not visible: `.tolist()` of a
          CPU tensor (it reads memory without an aten op; of a device tensor it shows as the copy to the CPU), and
          Python numbers that never were tensors (host counters), which is what code meant to run without syncs
          should hold.
A counter inside another (or inside FakeTensorMode) counts what reaches it. Nested calls made by a kernel itself
are not seen: the mode is off while one of its ops runs, as it is while the device runs it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
    "unique_dim", "unique_consecutive", "unique_dim_consecutive", "repeat_interleave", "equal", "is_nonzero",
    "bincount", "histc", "_assert_async",
})


@dataclass
class OpCounts:
    ops: int = 0                                              # aten ops dispatched, views included
    views: int = 0                                            # of which aliasing views
    syncs: int = 0                                            # host syncs (module docstring)
    by_op: Counter = field(default_factory=Counter)           # "aten.mul.Tensor" -> count
    sync_ops: Counter = field(default_factory=Counter)        # the sync points by op name

    def as_dict(self, top: int = 12) -> dict:
        """JSON-ready: the totals and the `top` most frequent ops."""
        return {"ops": self.ops, "views": self.views, "syncs": self.syncs, "sync_ops": dict(self.sync_ops),
                "top_ops": dict(self.by_op.most_common(top))}


def _is_device_to_host_copy(name: str, args, kwargs) -> bool:
    """copy_(dst on the CPU, src elsewhere) or _to_copy(src elsewhere, device=cpu)."""
    if name == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    if name == "_to_copy":
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    return False


class OpCounter(TorchDispatchMode):
    """Counts the aten ops, views and host syncs dispatched while active; the totals are in `counts`."""

    def __init__(self):
        super().__init__()
        self.counts = OpCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        c = self.counts   # counted before it runs: an op that fails (a meta tensor read) was still asked for
        c.ops += 1
        c.by_op[str(func)] += 1
        if func.is_view:
            c.views += 1
        if name in SYNC_OPS or _is_device_to_host_copy(name, args, kwargs):
            c.syncs += 1
            c.sync_ops[name] += 1
        return func(*args, **kwargs)


def count_ops(fn, *args, **kwargs) -> tuple[OpCounts, object]:
    """(counts, result) of one call of fn(*args, **kwargs) under an OpCounter."""
    with OpCounter() as counter:
        result = fn(*args, **kwargs)
    return counter.counts, result
