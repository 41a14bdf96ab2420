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
Host tensors: a CPU tensor that stays on the host on every device (torch Adam's step counters, the norm the joint
step hands DeepSpeed) reads like a device tensor on a CPU run, though on a GPU its `.item()` waits for nothing.
Name such tensors in `host_tensors`: they, and what ops compute from them alone on the CPU (DeepSpeed's
`bool(~isfinite(norm).any())`), are host tensors whose scalar reads are not counted as syncs (still as ops).
A counter inside another (or inside FakeTensorMode) counts what reaches it. Nested calls made by a kernel itself
are not seen: the mode is off while one of its ops runs, as it is while the device runs it.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
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

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.counts = OpCounts()
        self._host: dict[int, weakref.ref] = {}   # id -> the tensor (a weak reference: ids are reused)
        for t in host_tensors:
            self._add_host(t)

    def _add_host(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t)

    def _is_host(self, t) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        c = self.counts   # counted before it runs: an op that fails (a meta tensor read) was still asked for
        c.ops += 1
        c.by_op[str(func)] += 1
        if func.is_view:
            c.views += 1
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        from_host = bool(self._host) and bool(tensors) and all(self._is_host(t) for t in tensors)
        host_read = name == "_local_scalar_dense" and from_host
        if (name in SYNC_OPS or _is_device_to_host_copy(name, args, kwargs)) and not host_read:
            c.syncs += 1
            c.sync_ops[name] += 1
        out = func(*args, **kwargs)
        if from_host:   # a copy to a device (`.to(cuda)`) leaves the host: its later reads wait for the device
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self._add_host(t)
        return out


def count_ops(fn, *args, **kwargs) -> tuple[OpCounts, object]:
    """(counts, result) of one call of fn(*args, **kwargs) under an OpCounter."""
    with OpCounter() as counter:
        result = fn(*args, **kwargs)
    return counter.counts, result
