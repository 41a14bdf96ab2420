"""The sharded matrix engine: owns every backbone matrix of every method (DESIGN decisions 1-5, 10, 11).

Each matrix (compressed `values` of an NMSparseLinear, or the dense `weight` of a dense/latent projection)
is owned by one rank, chosen by greedy LPT on its update cost. Gradients leave autograd through
post-accumulate hooks (`.grad` is set to None, so DeepSpeed neither sees nor zeroes them) into fp32 gradient
buckets, which reduce-scatter them to the owners (distsparse/optim/grad_buckets.py: `full` holds a W x shard buffer
and reduces once per step, `sharded` reduces every micro-batch into an accumulator of the rank's own gradients).
On the accumulation boundary:

    gradient buckets   --reduce_scatter-->  own gradients (mean over ranks)                 phase 1: reduce
    own gradients      --sum of squares-->  local scalar (the joint step sums)              phase 2: norm
    owners: one group kernel per group of same-shape matrices (fp32 master and state)  phase 3: update
    owners: topology refresh of owned matrices, state follows its links                 phase 4: refresh
    codes [W * Sc] uint8 (after a refresh) and values [W * S] --all_gather--> every rank phase 5: gather

The bytes on the wire equal one all-reduce of the compressed gradients; Newton-Schulz runs once per matrix and
optimizer state is split 1/W.

State layout (DESIGN decision 21; distsparse/optim/matrix_groups.py): the matrices a rank updates are split into
groups of one key (values shape, dense frame, sparse or dense, dtype), and each group holds its fp32 masters and
rule slot tensors as flat stacked buffers [k, r, c] (row i: the group's i-th member in name order), its counters as
host ints, and a cached int32 kept index [k, r * c]. Phase 3 is one stacked gradient copy and one kernel of
distsparse/optim/group_rules.py per group (Newton-Schulz on the [k, out, in] batch), so a step's ops grow with the
number of groups (2-3 per model), not of matrices. `masters[name]` and `states[name]` are per-matrix views of the
rows; refreshes, checkpoints (per matrix, by name) and elastic resume (groups re-formed from the new owner map) go
through them. The per-matrix rules (rules_*.py) are the reference the group kernels are tested against.
`compile=True` (config optim.compile) runs the group kernels through torch.compile. Rule statistics (TANS's s,
gamma, base and corrected update RMS) are kept per matrix on steps that ask for them (`step(stats=True)`,
`rule_stats()`). Phase 5 writes a one-rank or replicated engine's masters back in one `_foreach_copy_`; the
multi-rank value gather still copies matrix by matrix into its chunks.

The joint step (distsparse/train/joint_step.py) drives these phases together with DeepSpeed's step: it owns the order, the one clip coefficient and the skip decision; the engine owns the buffers,
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
from distsparse.optim.grad_buckets import (BUCKET_BYTES, Comm, FullBuffer, ShardedAccumulator, align, bucket_layout,
                                           grad_bytes, resolve_grad_accum_mode)
from distsparse.optim.group_rules import GROUP_RULES, per_matrix
from distsparse.optim.matrix_groups import MatrixGroup, form_groups
from distsparse.optim.matrix_state import check_reset_mode, init_shadow, move_state, update_shadow
from distsparse.optim.owners import assign_owners, matrix_cost
from distsparse.optim.rules import get_rule
from distsparse.step_timer import NULL_TIMER, StepTimer
from distsparse.topology import RefreshResult
from distsparse.topology.origin import links_off_origin

GATHER_CHUNK = 1 << 24   # elements per rank in one values all-gather: staging stays (W + 1) x 64 MiB in fp32


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

    @property
    def sparse(self) -> bool:
        return isinstance(self.module, NMSparseLinear)

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def codes_numel(self) -> int:
        return self.module.codes.numel() if self.sparse else 0


# A topology policy's refresh of one matrix: (name, fp32 master [out, k], current meta) -> the new meta, the slot
# map and the master already in the new layout (distsparse.topology.RefreshResult).
RefreshFn = Callable[[str, torch.Tensor, NMMeta], RefreshResult]


def _overlaps(matrices: list[Matrix], start: int, end: int):
    """(matrix, lo, hi) for each matrix whose span [offset, offset + numel) in its owner's shard meets
    [start, end); lo and hi are shard positions."""
    for m in matrices:
        lo, hi = max(start, m.offset), min(end, m.offset + m.numel)
        if lo < hi:
            yield m, lo, hi


SHADOW = "shadow."   # state_dict key prefix of reset mode none's dense shadow tensors


class MatrixEngine:
    def __init__(self, modules: dict[str, nn.Module], *, rule: str, hparams, mode: str = "sharded",
                 reduce_dtype: str = "fp32", group=None, reset_mode: str = "changed",
                 initial_values: dict[str, torch.Tensor] | None = None, grad_accum_mode: str = "auto",
                 micro_batches: int = 1, num_buckets: int = 1, bucket_bytes: int = BUCKET_BYTES,
                 gather_chunk: int = GATHER_CHUNK, device: torch.device | str | None = None,
                 force_collectives: bool = False, compile: bool = False):
        """`modules`: the backbone by name. `grad_accum_mode` (auto | full | sharded) and `micro_batches` (per
        optimizer step) choose how gradients accumulate (grad_buckets.resolve_grad_accum_mode); `num_buckets`
        sizes full mode's buckets, `bucket_bytes` caps sharded mode's. `compile`: torch.compile the group kernels."""
        check_reset_mode(reset_mode)   # before any state is built, not at the first refresh
        self.rule_name, self.rule, self.hp = rule, get_rule(rule), hparams
        self.group_rule = GROUP_RULES[rule]
        # One compiled callable: dynamo keeps a graph per group shape (and per float-or-tensor coefficient).
        self._kernel = torch.compile(self.group_rule.kernel) if compile else self.group_rule.kernel
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
        self.shard_size = align(max(fill))
        self.codes_shard_size = align(max(codes_fill))
        device = torch.device(device) if device is not None else next(iter(params.values())).device
        self.device = device
        if micro_batches < 1:
            raise ValueError(f"micro_batches: got {micro_batches}; allowed: an integer >= 1")
        self.micro_batches = micro_batches
        self.grad_accum_mode = resolve_grad_accum_mode(grad_accum_mode, replicated=mode == "replicated",
                                                       world_size=self.world_size, micro_batches=micro_batches)
        numel = {name: params[name].numel() for name in modules}
        comm = Comm(group, self.rank, self.world_size, self.collectives, device, self.comm_device, self.reduce_dtype)
        if self.grad_accum_mode == "full":
            self.grad_layout = bucket_layout(numel, self.owners, self.world_size, num_buckets=num_buckets)
            self.grads = FullBuffer(self.grad_layout, self.owners, numel, comm, replicated=mode == "replicated")
        else:
            self.grad_layout = bucket_layout(numel, self.owners, self.world_size, bucket_bytes=bucket_bytes)
            self.grads = ShardedAccumulator(self.grad_layout, self.owners, numel, comm)
        self._pending_codes: dict[str, torch.Tensor] = {}
        self.last_refresh_seconds = 0.0

        local = list(self.matrices.values()) if mode == "replicated" else self.owned()
        self.groups: list[MatrixGroup] = form_groups(
            local, self.rule, device, initial_values, lambda m: self.grads.grad(m.name).view(m.param.shape))
        self._where = {name: (g, row) for g in self.groups for name, row in g.rows.items()}
        # Made once: what phase 2's norm and phase 5's local write-back read each step (no per-step view ops).
        self._own_grads = [self.grads.grad(m.name) for m in self.owned()]
        self._params = [p for g in self.groups for p in g.params]
        self._master_views = [v for g in self.groups for v in g.master_views]
        self._rule_stats: list[tuple[MatrixGroup, dict, dict]] = []
        # reset mode `none` (paper App. I.3): a dense [out, in] fp32 shadow of every slot tensor of each sparse
        # matrix updated here, holding a link's state from the moment it left (matrix_state.py; ablation only).
        self.shadows: dict[str, dict[str, torch.Tensor]] = {
            name: init_shadow(g.state_of(row), self.matrices[name].shape)
            for name, (g, row) in self._where.items() if reset_mode == "none" and self.matrices[name].sparse}
        # The step-0 codes of every sparse matrix updated here, for links_ever_changed (topology/origin.py).
        self.origin_codes = {n: self.matrices[n].module.codes.clone() for n in self._where if self.matrices[n].sparse}
        self._hooks = [m.param.register_post_accumulate_grad_hook(self._hook(m)) for m in self.matrices.values()]

    # ---- gradients ---------------------------------------------------------------------------------------

    def owned(self) -> list[Matrix]:
        return [m for m in self.matrices.values() if m.owner == self.rank]

    def updated_here(self) -> list[Matrix]:
        """Matrices this rank updates: its own (sharded) or all (replicated), in name order."""
        return [self.matrices[n] for n in sorted(self._where)]

    @property
    def masters(self) -> dict[str, torch.Tensor]:
        """fp32 master of every matrix this rank updates, by name: views of the group rows (write in place)."""
        return {name: g.master_views[row] for name, (g, row) in self._where.items()}

    @property
    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Rule state by name, laid out as rules.init_state: slot views of the group rows, 0-dim CPU counters
        (copies: counters are host ints, written back by the engine only)."""
        return {name: g.state_of(row) for name, (g, row) in self._where.items()}

    def _hook(self, m: Matrix):
        add = self.grads.add

        def accumulate(param: torch.Tensor) -> None:
            add(m.name, param.grad)   # fp32 accumulation; a complete bucket starts its reduce from here
            param.grad = None
        return accumulate

    def start_boundary(self) -> None:
        """Call before the backward of the last micro-batch of a step: buckets then reduce as they fill (full
        mode; sharded mode reduces them in every backward)."""
        self.grads.arm(last=True)

    def start_micro_step(self) -> None:
        """Call before a backward that does not end the step (full mode: no collectives)."""
        self.grads.arm(last=False)

    # ---- phase 1 and 2: reduce and norm ------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Mean over ranks of the step's gradients: owners hold theirs (sharded), or everyone all of them
        (replicated). Buckets already launched from the hooks are only waited for."""
        self.grads.reduce()

    @property
    def grad_buffer(self) -> torch.Tensor:
        """The flat fp32 gradient buffer [W * S] of a single-bucket full-mode engine (benchmarks fill it directly)."""
        if self.grad_accum_mode != "full" or len(self.grad_layout) != 1:
            raise ValueError(f"grad_buffer: needs grad_accum_mode=full and num_buckets=1, got "
                             f"{self.grad_accum_mode} with {len(self.grad_layout)} buckets")
        return self.grads.buffers[0]

    def grad_bytes(self) -> dict[str, int]:
        """Gradient bytes on this rank: `persistent` (held between steps: full mode's W x shard buffers or sharded
        mode's own accumulator) and `transient_peak` (the most staging, wire copies and reduce outputs held at
        once so far). `grad_buckets.grad_bytes` counts the same from the layout alone."""
        persistent = sum(t.untyped_storage().nbytes() for t in self.grads.persistent())
        return {"persistent": persistent, "transient_peak": self.grads.transient.peak}

    def expected_grad_bytes(self) -> dict[str, int]:
        """`grad_buckets.grad_bytes` for this engine's layout, rank and settings (what grad_bytes() should read
        after a step whose gradients arrived in layout order)."""
        wire_copy = self.reduce_dtype != torch.float32 or self.comm_device != self.device
        return grad_bytes(self.grad_layout, self.rank, self.world_size, self.grad_accum_mode,
                          micro_batches=self.micro_batches, reduce_itemsize=self.reduce_dtype.itemsize,
                          wire_copy=wire_copy)

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squared reduced gradients of the matrices this rank owns (in both modes, so that a sum over ranks
        counts every matrix once): a float64 0-dim tensor on the engine's device, inf or nan when a gradient is.
        One fp32 norm per matrix, so the result does not depend on the bucket layout or the accumulation mode."""
        if not self._own_grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch.stack(torch._foreach_norm(self._own_grads))   # one fp32 2-norm per matrix
        return norms.double().square().sum()

    def local_grads_nonfinite(self) -> torch.Tensor:
        """0 when this rank's own gradients are finite, inf otherwise (float64 0-dim): finiteness from each
        buffer's largest magnitude (an inf norm, which propagates nan and cannot overflow), one multi-tensor kernel
        reading each buffer once instead of an isfinite mask per buffer (issue 25). Empty buffers (a rank owning no
        matrix of a bucket) are left out: an inf norm of nothing has no identity and raises."""
        own = [t for t in self.grads.own() if t.numel()]
        if not own:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        ok = torch.stack(torch._foreach_norm(own, float("inf"))).isfinite().all()
        return torch.where(ok, 0.0, float("inf")).double()

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared norm over every rank's reduced gradients (one all-reduce): the engine alone, for tests
        and tools; a training step sums the local part with the dense side's (distsparse/train/joint_step.py)."""
        return ddist.dist_sum(self.local_grad_sq_norm(), self.group) if self.collectives else \
            self.local_grad_sq_norm()

    # ---- phase 3-5: update, refresh, gather --------------------------------------------------------------

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0, refresh: RefreshFn | None = None, *,
             stats: bool = False, timer: StepTimer = NULL_TIMER) -> dict[str, dict]:
        """Update every matrix this rank is responsible for, refresh topologies when `refresh` is given,
        then distribute codes and values. Returns refresh stats keyed by matrix name (this rank's). `stats`
        (logging steps) keeps the rule's per-matrix statistics for `rule_stats()`; `timer` marks the phases."""
        self._rule_stats = []
        for group in self.groups:
            grad = group.stacked_grads()                         # [k, r, c]
            if clip_coef != 1.0:
                grad.mul_(clip_coef)
            coefficients = self.group_rule.advance(group.counters, self.hp)   # host: counters + 1
            extra = {"pruned": group.support_complement()} if self.rule.needs_support_mask else {}
            out = self._kernel(group.master, grad, group.slots, lr=lr, hp=self.hp, index=group.step_index(),
                               frame=group.frame, stats=stats,
                               **{k: per_matrix(v, self.device) for k, v in coefficients.items()}, **extra)
            if stats and out is not None:
                self._rule_stats.append((group, out, self.group_rule.host_stats(coefficients)))
        timer.mark("backbone_step")
        t0 = time.perf_counter()
        stats = self._refresh(refresh) if refresh is not None else {}
        self.last_refresh_seconds = time.perf_counter() - t0
        timer.mark("refresh")
        self._distribute_values()
        timer.mark("gather")
        return stats

    def _refresh(self, refresh: RefreshFn) -> dict[str, dict]:
        stats, off_origin = {}, []
        for m in self.updated_here():
            if not m.sparse:
                continue
            group, row = self._where[m.name]
            outcome = refresh(m.name, group.master_views[row], m.module.meta)
            self.on_refresh(m.name, outcome)
            stats[m.name] = {**outcome.stats, "links_kept": float(m.numel)}
            off_origin.append(links_off_origin(outcome.meta, self.origin_codes[m.name]))
        for s, off in zip(stats.values(), torch.stack(off_origin).tolist() if off_origin else []):   # one read
            s["links_off_origin"] = float(off)
        self._distribute_codes()
        return stats

    def on_refresh(self, name: str, outcome: RefreshResult) -> None:
        """State follows its links (DESIGN decision 11). `outcome.new_values` is the master already in the new
        layout (kept links moved, new slots initialized by the topology policy); the rule state is moved here.
        The module still holds the old codes (new ones are installed after every owner has refreshed)."""
        shadow, new_index = self.shadows.get(name), None
        group, row = self._where[name]
        state = group.state_of(row)
        if shadow is not None:
            update_shadow(shadow, kept_index(self.matrices[name].module.meta), state)
            new_index = kept_index(outcome.meta)
        _, state = move_state(state, outcome.new_values, outcome.slots, self.reset_mode, shadow=shadow,
                              new_index=new_index)
        group.set_row(row, outcome.new_values, state)   # the kept index row follows the new codes when installed
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
            torch._foreach_copy_(self._params, self._master_views)   # one op for every matrix (cast to its dtype)
            return
        # The shards travel in chunks: a whole-shard gather would stage (W + 1) x shard, 1.7 GiB per rank at 1b.
        dtype = next(iter(self.matrices.values())).param.dtype   # bf16 on the wire when training in bf16
        chunk, w = min(self.gather_chunk, self.shard_size), self.world_size
        send = torch.empty(chunk, dtype=dtype, device=self.comm_device)
        recv = torch.empty(w * chunk, dtype=dtype, device=self.comm_device)
        owned, everyone = self.owned(), list(self.matrices.values())
        masters = self.masters
        for start in range(0, self.shard_size, chunk):
            n = min(chunk, self.shard_size - start)
            send[:n].zero_()
            for m, lo, hi in _overlaps(owned, start, start + n):
                send[lo - start:hi - start] = masters[m.name].reshape(-1)[lo - m.offset:hi - m.offset]
            dist.all_gather_into_tensor(recv[:w * n], send[:n], group=self.group)
            for m, lo, hi in _overlaps(everyone, start, start + n):
                src = m.owner * n + lo - start
                m.param.data.view(-1)[lo - m.offset:hi - m.offset].copy_(recv[src:src + hi - lo])

    def zero_grad(self) -> None:
        self.grads.zero()

    def grads_finite(self) -> bool:
        """Agreed across ranks (one all-reduce and a host read): the engine alone, for tests and tools."""
        bad = self.local_grads_nonfinite()
        return bool(torch.isfinite(ddist.dist_sum(bad, self.group) if self.collectives else bad))

    # ---- state for checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-matrix state of the matrices this rank owns, keyed by parameter name: compact copies of the group
        rows (master, slot tensors), 0-dim int64 counters, codes, the step-0 codes, reset mode none's shadows."""
        out = {}
        for m in self.owned():
            group, row = self._where[m.name]
            entry = {"master": group.master_views[row].clone(),
                     **{k: v.clone() for k, v in group.state_of(row).items()}}
            if m.sparse:
                entry["codes"], entry["origin_codes"] = m.module.codes.clone(), self.origin_codes[m.name].clone()
            entry.update({SHADOW + k: v.clone() for k, v in self.shadows.get(m.name, {}).items()})
            out[m.name] = entry
        return out

    def load_state_dict(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load the entries this rank updates into their group rows (owners and groups may differ from the saving
        run: keyed by name)."""
        for name, (group, row) in self._where.items():
            if name not in states:
                raise KeyError(f"matrix state for {name!r} missing from the checkpoint")
            entry = dict(states[name])
            master = entry.pop("master")
            codes = entry.pop("codes", None)
            origin = entry.pop("origin_codes", codes)   # a checkpoint from before it: counted from its topology
            if name in self.origin_codes and origin is not None:
                self.origin_codes[name] = origin.to(self.origin_codes[name].device).clone()
            if codes is not None:
                self.matrices[name].module.set_codes(codes.to(self.matrices[name].module.codes.device))
            shadow = {k[len(SHADOW):]: entry.pop(k).to(self.device) for k in list(entry) if k.startswith(SHADOW)}
            if name in self.shadows:
                if set(shadow) != set(self.shadows[name]):
                    raise KeyError(f"matrix state for {name!r}: reset mode 'none' needs its shadow "
                                   f"{sorted(self.shadows[name])} in the checkpoint, found {sorted(shadow)}")
                self.shadows[name] = shadow
            missing = [k for k in self.rule.state_keys if k not in entry]
            if missing:
                raise KeyError(f"matrix state for {name!r}: rule {self.rule_name!r} needs {list(self.rule.state_keys)}"
                               f" in the checkpoint, missing {missing}")
            group.set_row(row, master, entry)

    def state_bytes(self) -> int:
        """Bytes of backbone optimizer state on this rank: masters, rule state (counters at their saved 8 B), reset
        mode none's shadows and the persistent gradient bytes (grad_bytes()). The groups' derived caches are
        `cache_bytes()`, the step-0 codes `origin_code_bytes()`."""
        shadows = sum(t.untyped_storage().nbytes() for s in self.shadows.values() for t in s.values())
        return sum(g.state_bytes() for g in self.groups) + shadows + self.grad_bytes()["persistent"]

    def origin_code_bytes(self) -> int:
        """Bytes of the step-0 codes this rank keeps (topology/origin.py; memory_estimate's `origin_codes`)."""
        return sum(t.untyped_storage().nbytes() for t in self.origin_codes.values())

    def cache_bytes(self) -> int:
        """Bytes of the groups' derived caches on this rank: the int32 kept index of the sparse groups (4 B per
        value) and, for rules that need the support, its complement (1 B per dense entry)."""
        return sum(g.cache_bytes() for g in self.groups)

    def rule_stats(self) -> dict[str, dict[str, float]]:
        """The rule's per-matrix statistics of the last `step(stats=True)`, for the matrices this rank owns (so a
        merge over ranks counts each once in replicated mode too): name -> {stat: value}; a statistic a matrix
        did not have that step (TANS's rms_scale when Newton-Schulz did not run) is absent. One host read."""
        rows, device_stats = [], []
        for group, out, host in self._rule_stats:
            keys = [k for k, v in out.items() if v is not None]
            device_stats += [torch.as_tensor(out[k], dtype=torch.float32, device=self.device).expand(
                len(group), 1, 1).reshape(-1) for k in keys]
            rows.append((group, keys, host))
        values = torch.cat(device_stats).tolist() if device_stats else []   # the one read, logging steps only
        result, at = {}, 0
        for group, keys, host in rows:
            k = len(group)
            columns = {key: values[at + j * k:at + (j + 1) * k] for j, key in enumerate(keys)}
            at += len(keys) * k
            columns.update(host)
            for i, name in enumerate(group.names):
                if self.matrices[name].owner == self.rank:
                    result[name] = {key: float(column[i]) for key, column in columns.items()}
        return result

    def comm_bytes_per_step(self, refresh_interval: int | None) -> dict[str, float]:
        """Bytes this rank sends per optimizer step in the backbone collectives, padding included.

        Ring algorithms (NCCL's bus-bandwidth model): reduce-scatter and all-gather send W-1 shards, an
        all-reduce 2 (W-1)/W of its buffer. `reduce`: the gradient buckets in `reduce_dtype`, once per step (full
        mode) or once per micro-batch (sharded mode, `micro_batches` per step); `values`: the
        all-gather in the backbone dtype; `codes`: the uint8 code all-gather that follows a refresh, amortized over
        `refresh_interval` steps (None: no refreshes). Replicated mode all-reduces and gathers nothing. The step's
        scalars travel in the joint step's one all-reduce (JointOptimizer.scalar_bytes_per_step).
        """
        if refresh_interval is not None and (not isinstance(refresh_interval, int) or refresh_interval < 1):
            raise ValueError(f"refresh_interval: got {refresh_interval!r}; allowed: None or an integer >= 1")
        w = self.world_size
        out = {"reduce": 0.0, "values": 0.0, "codes": 0.0}
        if w > 1:
            out["reduce"] = self.grads.reduce_bytes_per_step(self.micro_batches)
            if self.mode != "replicated":
                values_dtype = next(iter(self.matrices.values())).param.dtype
                out["values"] = float((w - 1) * self.shard_size * values_dtype.itemsize)
                if refresh_interval is not None:
                    out["codes"] = (w - 1) * self.codes_shard_size / refresh_interval
        out["total"] = sum(out.values())
        return out
