"""Memory, measured one way (DESIGN s6).

Byte counts: sums of `untyped_storage().nbytes()` over deduplicated storages (views and aliases count once):
`storage_bytes` over given tensors, `held_bytes` over everything a module holds, `LiveTensorBytes` the peak of that
sum over the storages aten ops allocate while it is active. Peak memory of a process: its resident high-water mark,
VmHWM of /proc/self/status, in a fresh process (`fresh_peaks`) or after `reset_peak` in a reused one, minus an idle
baseline. Not ru_maxrss: Linux carries it across fork and exec, so a child's ru_maxrss is at least its parent's RSS
at the fork, which hides the peak being measured.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from distsparse.utils import storage_bytes   # the one byte count (DESIGN s6), also the DeepSpeed side's

ROOT = Path(__file__).resolve().parents[1]


def held_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor reachable from the module and its submodules: parameters, buffers and any attribute holding a
    tensor, also inside lists, tuples, sets, dicts and dataclasses (a cache cannot hide). Not the `.grad`s."""
    found: list[torch.Tensor] = []
    visited: set[int] = set()

    def visit(obj: Any) -> None:
        if id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                visit(getattr(obj, field.name))

    for m in module.modules():
        for name, attr in vars(m).items():
            if name != "_modules":   # submodules are visited by `modules()` themselves
                visit(attr)
    return found


def held_bytes(module: torch.nn.Module) -> int:
    return storage_bytes(held_tensors(module))


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live tensor storages, and their peak, while the mode is active.

    Every storage is counted once (views share it), from the op that returns it, or from `hold` for tensors that
    exist before, until Python frees it (a weakref finalizer subtracts it). Storages that an op allocates and frees
    internally without returning them are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self._seen = WeakIdKeyDictionary()
        self.current = self.peak = 0

    def hold(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._count(t)

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def _count(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        nbytes = self._seen[storage] = storage.nbytes()
        weakref.finalize(storage, self._free, nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._count(t)
        return out


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024   # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (VmHWM)."""
    return _status_bytes("VmHWM")


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS")


def reset_peak() -> None:
    """Set VmHWM to the current resident set (Linux >= 4.0, proc(5) clear_refs): the peak from here is the run's."""
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


def fresh_peaks(code: str, argvs: list[list[str]], threads: int = 1) -> list[int]:
    """Peak RSS bytes of fresh interpreters running `code` (one per argv in `argvs`, `sys.argv[1:]`), started
    together: RSS is per process, so they may overlap."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    tail = "\nfrom bench.memory import peak_rss_bytes\nprint(peak_rss_bytes())\n"
    procs = [subprocess.Popen([sys.executable, "-c", code + tail, *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for argv in argvs]
    peaks = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"fresh process {proc.args[3:]} failed with exit code {proc.returncode}:\n{err}")
        peaks.append(int(out.split()[-1]))
    return peaks
