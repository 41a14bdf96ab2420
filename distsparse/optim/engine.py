"""The sharded matrix engine: owns every backbone matrix of every method (DESIGN decisions 1-5, 10, 11).

Each matrix (compressed `values` of an NMSparseLinear, or the dense `weight` of a dense/latent projection)
is owned by one rank, chosen by greedy LPT on its update cost. Gradients leave autograd through
post-accumulate hooks into one shard-aligned fp32 flat buffer (`.grad` is set to None, so DeepSpeed neither
sees nor zeroes them). On the accumulation boundary:

    grad buffer [W * S] fp32   --reduce_scatter-->  own shard [S] (mean over ranks)      phase 1: reduce
    own shard                  --sum of squares-->  local scalar (the joint step sums)  phase 2: norm
    owners: rule(master, grad * clip) for each owned matrix (fp32 master and state)     phase 3: update
    owners: topology refresh of owned matrices, state follows its links                 phase 4: refresh
    codes [W * Sc] uint8 (after a refresh) and values [W * S] --all_gather--> every rank phase 5: gather

The bytes on the wire equal one all-reduce of the compressed gradients; Newton-Schulz runs once per matrix and
optimizer state is split 1/W. The joint step (distsparse/train/joint_step.py) drives these phases together with
DeepSpeed's step: it owns the order, the one clip coefficient and the skip decision; the engine owns the buffers,
the collectives of the backbone and the per-matrix state. `mode="replicated"` all-reduces the buffer and lets every
rank update every matrix: the same code with every matrix owned locally, kept as the test oracle. With one process
every collective is skipped (`force_collectives` runs them anyway, so a one-GPU check exercises them on NCCL).

Devices (DESIGN decision 17): masters, rule state, gradient buckets and refresh work live on `device`, the one
DeepSpeed put the model on; every tensor handed to a collective lives on `ddist.comm_device(group)` (the CUDA
device under NCCL, the CPU under gloo). When the two differ, the wire tensors are staged copies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distsparse import dist as ddist
from distsparse.layers import NMSparseLinear
from distsparse.models import backbone_param
from distsparse.nm import NMMeta, kept_index
from distsparse.optim.matrix_state import RESET_MODES, init_shadow, move_state, update_shadow
from distsparse.optim.owners import assign_owners, matrix_cost
from distsparse.optim.rules import get_rule, init_state
from distsparse.topology import RefreshResult

ALIGN = 128   # shard length alignment (elements)
GATHER_CHUNK = 1 << 24   # elements per rank in one values all-gather: staging stays (W + 1) x 64 MiB in fp32


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Matrix:
    """One backbone matrix and where it lives in the flat buffers."""
    name: str
    module: nn.Module
    param: nn.Parameter
    shape: tuple[int, int]        # dense frame (out, in)
    owner: int
    offset: int                   # in the owner's value shard
    codes_offset: int             # in the owner's codes shard
    bucket: int = 0               # gradient bucket
    grad_offset: int = 0          # in the owner's shard of that bucket

    @property
    def sparse(self) -> bool:
        return isinstance(self.module, NMSparseLinear)

    @property
    def index(self) -> torch.Tensor | None:
        return self.module.index if self.sparse else None

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def codes_numel(self) -> int:
        return self.module.codes.numel() if self.sparse else 0


# A topology policy's refresh of one matrix: (name, fp32 master [out, k], current meta) -> the new meta, the slot
# map and the master already in the new layout (distsparse.topology.RefreshResult).
RefreshFn = Callable[[str, torch.Tensor, NMMeta], RefreshResult]


@dataclass
class GradBucket:
    """A group of matrices whose gradients are reduced together; shard r of `buffer` holds r's matrices."""
    names: list[str]
    shard_size: int
    buffer: torch.Tensor          # fp32 [W * shard_size]
    arrived: int = 0              # gradients accumulated in the current backward
    handle: object = None         # in-flight async collective
    wire: torch.Tensor | None = None
    out: torch.Tensor | None = None


def _overlaps(matrices: list[Matrix], start: int, end: int):
    """(matrix, lo, hi) for each matrix whose span [offset, offset + numel) in its owner's shard meets
    [start, end); lo and hi are shard positions."""
    for m in matrices:
        lo, hi = max(start, m.offset), min(end, m.offset + m.numel)
        if lo < hi:
            yield m, lo, hi


def bucket_layout(numel: dict[str, int], owners: dict[str, int], world_size: int, num_buckets: int
                  ) -> list[tuple[list[str], int, dict[str, int]]]:
    """Split the matrices into buckets in reverse name order (deepest layers first, roughly the order in which
    backward produces their gradients), so a bucket's reduce-scatter can start while backward still runs on
    earlier layers. Per bucket: its names, its aligned shard size and each matrix's offset in its owner's shard."""
    if num_buckets < 1:
        raise ValueError(f"engine.num_buckets: got {num_buckets}; allowed: an integer >= 1")
    names = sorted(numel, reverse=True)
    per = -(-len(names) // num_buckets)
    layout = []
    for start in range(0, len(names), per):
        fill, offsets = [0] * world_size, {}
        for name in names[start:start + per]:
            offsets[name] = fill[owners[name]]
            fill[owners[name]] += numel[name]
        layout.append((names[start:start + per], _align(max(fill)), offsets))
    return layout


SHADOW = "shadow."   # state_dict key prefix of reset mode none's dense shadow tensors


class MatrixEngine:
    def __init__(self, modules: dict[str, nn.Module], *, rule: str, hparams, mode: str = "sharded",
                 reduce_dtype: str = "fp32", group=None, reset_mode: str = "changed",
                 initial_values: dict[str, torch.Tensor] | None = None, num_buckets: int = 1,
                 gather_chunk: int = GATHER_CHUNK, device: torch.device | str | None = None,
                 force_collectives: bool = False):
        if reset_mode not in RESET_MODES:
            raise ValueError(f"reset_mode: got {reset_mode!r}; allowed: {', '.join(RESET_MODES)}")
        self.rule, self.hp = get_rule(rule), hparams
        self.mode, self.group, self.reset_mode = mode, group, reset_mode
        self.reduce_dtype = torch.bfloat16 if reduce_dtype == "bf16" else torch.float32
        if gather_chunk < 1:
            raise ValueError(f"gather_chunk: got {gather_chunk}; allowed: an integer >= 1")
        self.gather_chunk = gather_chunk
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        if force_collectives and not self.distributed:
            raise ValueError("engine.force_collectives: got True without a process group; allowed: True only "
                             "under a distributed launch (it runs the collectives of a world of one)")
        self.collectives = self.world_size > 1 or force_collectives
        self.comm_device = ddist.comm_device(group)
        ns_steps = getattr(hparams, "ns_steps", 5)

        costs, params = {}, {}
        for name, module in modules.items():
            param = backbone_param(module)
            params[name] = param
            costs[name] = matrix_cost(rule, (module.out_features, module.in_features), param.numel(), ns_steps)
        self.costs = costs
        self.owners = assign_owners(costs, self.world_size)

        # Shard-aligned layout: shard r holds r's matrices back to back, in name order.
        self.matrices: dict[str, Matrix] = {}
        fill, codes_fill = [0] * self.world_size, [0] * self.world_size
        for name in sorted(modules):
            module, r = modules[name], self.owners[name]
            m = Matrix(name, module, params[name], (module.out_features, module.in_features), r,
                       fill[r], codes_fill[r])
            fill[r] += m.numel
            codes_fill[r] += m.codes_numel
            self.matrices[name] = m
        self.shard_size = _align(max(fill))
        self.codes_shard_size = _align(max(codes_fill))
        device = torch.device(device) if device is not None else next(iter(params.values())).device
        self.device = device
        self.buckets = self._make_buckets(num_buckets, device)
        self._boundary = False
        self._pending_codes: dict[str, torch.Tensor] = {}
        self.last_refresh_seconds = 0.0

        local = self.matrices.values() if mode == "replicated" else self.owned()
        self.masters: dict[str, torch.Tensor] = {}
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        for m in local:
            init = initial_values[m.name] if initial_values else m.param.detach()
            self.masters[m.name] = init.to(device=device, dtype=torch.float32).clone()
            self.states[m.name] = init_state(rule, tuple(m.param.shape), device)
        # reset mode `none` (paper App. I.3): a dense [out, in] fp32 shadow of every slot tensor of each sparse
        # matrix updated here, holding a link's state from the moment it left (matrix_state.py; ablation only).
        self.shadows: dict[str, dict[str, torch.Tensor]] = {
            name: init_shadow(self.states[name], self.matrices[name].shape)
            for name in self.masters if reset_mode == "none" and self.matrices[name].sparse}
        self._hooks = [m.param.register_post_accumulate_grad_hook(self._hook(m)) for m in self.matrices.values()]

    # ---- layout ------------------------------------------------------------------------------------------

    def _make_buckets(self, num_buckets: int, device) -> list[GradBucket]:
        buckets = []
        layout = bucket_layout({n: m.numel for n, m in self.matrices.items()}, self.owners, self.world_size,
                               num_buckets)
        for b, (names, size, offsets) in enumerate(layout):
            for name in names:
                self.matrices[name].bucket, self.matrices[name].grad_offset = b, offsets[name]
            buckets.append(GradBucket(names, size,
                                      torch.zeros(self.world_size * size, dtype=torch.float32, device=device)))
        return buckets

    def owned(self) -> list[Matrix]:
        return [m for m in self.matrices.values() if m.owner == self.rank]

    def updated_here(self) -> list[Matrix]:
        """Matrices this rank updates: its own (sharded) or all (replicated)."""
        return [self.matrices[n] for n in self.masters]

    def _grad_view(self, m: Matrix) -> torch.Tensor:
        bucket = self.buckets[m.bucket]
        start = m.owner * bucket.shard_size + m.grad_offset
        return bucket.buffer[start:start + m.numel]

    def _hook(self, m: Matrix):
        view, bucket = self._grad_view(m), self.buckets[m.bucket]

        def accumulate(param: torch.Tensor) -> None:
            view.add_(param.grad.reshape(-1).float())   # fp32 accumulation across micro-batches
            param.grad = None
            bucket.arrived += 1
            if self._boundary and bucket.arrived == len(bucket.names):
                self._launch(bucket)   # overlap: reduce this bucket while backward continues
        return accumulate

    def start_boundary(self) -> None:
        """Call before the backward of the last micro-batch of a step: buckets then reduce as they fill."""
        self._boundary = True
        for bucket in self.buckets:
            bucket.arrived = 0

    def start_micro_step(self) -> None:
        """Call before a backward that does not end the step (no collectives)."""
        for bucket in self.buckets:
            bucket.arrived = 0

    # ---- phase 1 and 2: reduce and norm ------------------------------------------------------------------

    def _launch(self, bucket: GradBucket) -> None:
        if not self.collectives or bucket.handle is not None:
            return
        bucket.wire = bucket.buffer.to(self.comm_device, self.reduce_dtype)
        if self.mode == "replicated":
            bucket.handle = dist.all_reduce(bucket.wire, group=self.group, async_op=True)
        else:
            bucket.out = torch.empty(bucket.shard_size, dtype=self.reduce_dtype, device=self.comm_device)
            bucket.handle = dist.reduce_scatter_tensor(bucket.out, bucket.wire, group=self.group, async_op=True)

    def reduce_gradients(self) -> None:
        """Mean over ranks: owners receive their shard (sharded) or everyone the whole buffer (replicated).
        Buckets already launched from the hooks are only waited for."""
        self._boundary = False
        if not self.collectives:
            return
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            if self.mode == "replicated":
                bucket.buffer.copy_(bucket.wire)
            else:
                self._own_shard(bucket).copy_(bucket.out)
            bucket.buffer.div_(self.world_size)
            bucket.handle = bucket.wire = bucket.out = None

    def _own_shard(self, bucket: GradBucket) -> torch.Tensor:
        return bucket.buffer[self.rank * bucket.shard_size:(self.rank + 1) * bucket.shard_size]

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat fp32 gradient buffer [W * S] of a single-bucket engine (benchmarks fill it directly)."""
        assert len(self.buckets) == 1, f"grad_buffer needs num_buckets=1, got {len(self.buckets)}"
        return self.buckets[0].buffer

    @property
    def grad_shard_total(self) -> int:
        """Elements of one rank's gradient shards over all buckets (padding included)."""
        return sum(b.shard_size for b in self.buckets)

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squared reduced gradients of the matrices this rank is responsible for in the norm (its own
        shards in both modes, so that a sum over ranks counts every matrix once): a float64 0-dim tensor on the
        engine's device, inf or nan when a gradient is. Norms per bucket in fp32 (no fp64 copy of the shard)."""
        norms = torch.stack([torch.linalg.vector_norm(self._own_shard(b)) for b in self.buckets])
        return norms.double().square().sum()

    def local_grads_nonfinite(self) -> torch.Tensor:
        """0 when this rank's own shards are finite, inf otherwise (float64 0-dim): finiteness without a norm."""
        ok = torch.stack([torch.isfinite(self._own_shard(b)).all() for b in self.buckets]).all()
        return torch.where(ok, 0.0, float("inf")).double()

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared norm over every rank's reduced gradients (one all-reduce): the engine alone, for tests
        and tools; a training step sums the local part with the dense side's (distsparse/train/joint_step.py)."""
        return ddist.dist_sum(self.local_grad_sq_norm(), self.group) if self.collectives else \
            self.local_grad_sq_norm()

    # ---- phase 3-5: update, refresh, gather --------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0, refresh: RefreshFn | None = None) -> dict[str, dict]:
        """Update every matrix this rank is responsible for, refresh topologies when `refresh` is given,
        then distribute codes and values. Returns refresh stats keyed by matrix name (this rank's)."""
        for m in self.updated_here():
            grad = self._grad_view(m).view(m.param.shape)
            if clip_coef != 1.0:
                grad = grad * clip_coef
            extra = {"mask": m.module.current_mask()} if self.rule.needs_support_mask else {}
            self.rule.step(self.masters[m.name], grad, self.states[m.name], lr=lr, hp=self.hp,
                           index=m.index, shape=m.shape, **extra)
        t0 = time.perf_counter()
        stats = self._refresh(refresh) if refresh is not None else {}
        self.last_refresh_seconds = time.perf_counter() - t0
        self._distribute_values()
        return stats

    def _refresh(self, refresh: RefreshFn) -> dict[str, dict]:
        stats = {}
        for m in self.updated_here():
            if not m.sparse:
                continue
            outcome = refresh(m.name, self.masters[m.name], m.module.meta)
            self.on_refresh(m.name, outcome)
            stats[m.name] = outcome.stats
        self._distribute_codes()
        return stats

    def on_refresh(self, name: str, outcome: RefreshResult) -> None:
        """State follows its links (DESIGN decision 11). `outcome.new_values` is the master already in the new
        layout (kept links moved, new slots initialized by the topology policy); the rule state is moved here.
        The module still holds the old codes (new ones are installed after every owner has refreshed)."""
        shadow, new_index = self.shadows.get(name), None
        if shadow is not None:
            update_shadow(shadow, self.matrices[name].index.long(), self.states[name])
            new_index = kept_index(outcome.meta)
        _, state = move_state(self.states[name], outcome.new_values, outcome.slots, self.reset_mode, shadow=shadow,
                              new_index=new_index)
        self.masters[name], self.states[name] = outcome.new_values, state
        self._pending_codes[name] = outcome.meta.codes

    def _distribute_codes(self) -> None:
        pending, self._pending_codes = self._pending_codes, {}
        if self.mode == "replicated" or not self.collectives:
            for name, codes in pending.items():
                self.matrices[name].module.set_codes(codes)
            return
        sparse = [m for m in self.matrices.values() if m.sparse]
        send = torch.zeros(self.codes_shard_size, dtype=torch.uint8, device=self.comm_device)
        for m in self.owned():
            if m.sparse:
                codes = pending.get(m.name, m.module.codes)
                send[m.codes_offset:m.codes_offset + m.codes_numel] = codes.reshape(-1)
        recv = torch.empty(self.world_size * self.codes_shard_size, dtype=torch.uint8, device=self.comm_device)
        dist.all_gather_into_tensor(recv, send, group=self.group)
        for m in sparse:
            start = m.owner * self.codes_shard_size + m.codes_offset
            codes = recv[start:start + m.codes_numel].view(m.module.codes.shape).to(m.module.codes.device)
            if not torch.equal(codes, m.module.codes):
                m.module.set_codes(codes)

    def _distribute_values(self) -> None:
        if self.mode == "replicated" or not self.collectives:
            for m in self.updated_here():
                m.param.data.copy_(self.masters[m.name].view(m.param.shape))
            return
        # The shards travel in chunks: a whole-shard gather would stage (W + 1) x shard, 1.7 GiB per rank at 1b.
        dtype = next(iter(self.matrices.values())).param.dtype   # bf16 on the wire when training in bf16
        chunk, w = min(self.gather_chunk, self.shard_size), self.world_size
        send = torch.empty(chunk, dtype=dtype, device=self.comm_device)
        recv = torch.empty(w * chunk, dtype=dtype, device=self.comm_device)
        owned, everyone = self.owned(), list(self.matrices.values())
        for start in range(0, self.shard_size, chunk):
            n = min(chunk, self.shard_size - start)
            send[:n].zero_()
            for m, lo, hi in _overlaps(owned, start, start + n):
                send[lo - start:hi - start] = self.masters[m.name].reshape(-1)[lo - m.offset:hi - m.offset]
            dist.all_gather_into_tensor(recv[:w * n], send[:n], group=self.group)
            for m, lo, hi in _overlaps(everyone, start, start + n):
                src = m.owner * n + lo - start
                m.param.data.view(-1)[lo - m.offset:hi - m.offset].copy_(recv[src:src + hi - lo])

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def grads_finite(self) -> bool:
        """Agreed across ranks (one all-reduce and a host read): the engine alone, for tests and tools."""
        bad = self.local_grads_nonfinite()
        return bool(torch.isfinite(ddist.dist_sum(bad, self.group) if self.collectives else bad))

    # ---- state for checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-matrix state of the matrices this rank owns, keyed by parameter name."""
        out = {}
        for m in self.owned():
            entry = {"master": self.masters[m.name].clone(), **{k: v.clone() for k, v in self.states[m.name].items()}}
            if m.sparse:
                entry["codes"] = m.module.codes.clone()
            entry.update({SHADOW + k: v.clone() for k, v in self.shadows.get(m.name, {}).items()})
            out[m.name] = entry
        return out

    def load_state_dict(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load the entries this rank updates (owners may differ from the saving run: keyed by name)."""
        for name in self.masters:
            if name not in states:
                raise KeyError(f"matrix state for {name!r} missing from the checkpoint")
            entry = dict(states[name])
            self.masters[name] = entry.pop("master").to(self.device, torch.float32)
            codes = entry.pop("codes", None)
            if codes is not None:
                self.matrices[name].module.set_codes(codes.to(self.matrices[name].module.codes.device))
            shadow = {k[len(SHADOW):]: entry.pop(k).to(self.device) for k in list(entry) if k.startswith(SHADOW)}
            if name in self.shadows:
                if set(shadow) != set(self.shadows[name]):
                    raise KeyError(f"matrix state for {name!r}: reset mode 'none' needs its shadow "
                                   f"{sorted(self.shadows[name])} in the checkpoint, found {sorted(shadow)}")
                self.shadows[name] = shadow
            self.states[name] = {k: v.to(self.device) if v.dim() else v for k, v in entry.items()}

    def state_bytes(self) -> int:
        """Bytes of backbone optimizer state on this rank: masters, rule state (and shadows) and the gradient
        buffer."""
        tensors = list(self.masters.values()) + [t for s in self.states.values() for t in s.values()]
        tensors += [t for s in self.shadows.values() for t in s.values()]
        buffers = sum(b.buffer.untyped_storage().nbytes() for b in self.buckets)
        return sum(t.untyped_storage().nbytes() for t in tensors) + buffers

    def comm_bytes_per_step(self, refresh_interval: int | None) -> dict[str, float]:
        """Bytes this rank sends per optimizer step in the backbone collectives, padding included.

        Ring algorithms (NCCL's bus-bandwidth model): reduce-scatter and all-gather send W-1 shards, an
        all-reduce 2 (W-1)/W of its buffer. `reduce`: the gradient buffer in `reduce_dtype`; `values`: the
        all-gather in the backbone dtype; `codes`: the uint8 code all-gather that follows a refresh, amortized over
        `refresh_interval` steps (None: no refreshes). Replicated mode all-reduces and gathers nothing. The step's
        scalars travel in the joint step's one all-reduce (JointOptimizer.scalar_bytes_per_step).
        """
        if refresh_interval is not None and (not isinstance(refresh_interval, int) or refresh_interval < 1):
            raise ValueError(f"refresh_interval: got {refresh_interval!r}; allowed: None or an integer >= 1")
        w = self.world_size
        out = {"reduce": 0.0, "values": 0.0, "codes": 0.0}
        if w > 1:
            if self.mode == "replicated":
                out["reduce"] = 2 * (w - 1) / w * w * self.grad_shard_total * self.reduce_dtype.itemsize
            else:
                values_dtype = next(iter(self.matrices.values())).param.dtype
                out["reduce"] = float((w - 1) * self.grad_shard_total * self.reduce_dtype.itemsize)
                out["values"] = float((w - 1) * self.shard_size * values_dtype.itemsize)
                if refresh_interval is not None:
                    out["codes"] = (w - 1) * self.codes_shard_size / refresh_interval
        out["total"] = sum(out.values())
        return out
