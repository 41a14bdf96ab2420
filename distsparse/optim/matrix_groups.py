"""The matrix engine's state storage: the matrices a rank updates, in flat per-group buffers (DESIGN decision 21;
issue 25 item 1). The engine (engine.py) forms the groups from its owner map and runs one group kernel
(group_rules.py) per group and step; checkpoints and refreshes still see one matrix at a time, by name.

Layout, per rank:
  groups     the matrices this rank updates (its own; every matrix in replicated mode), split by `GroupKey`
             (values shape, dense frame, sparse or dense, parameter dtype: whatever changes the math of a rule) and
             ordered by their first member's name; members in name order. A matrix lives at (group, row).
  master     fp32 [k, r, c], row i member i's master ([out, kept] compressed values, or [out, in] dense)
  slots      the rule's slot tensors (rules.Rule.slot_keys: TANS V and P, Muon's momentum, Adam's moments), fp32
             [k, r, c] each, rows as master
  counters   the rule's counters (Rule.counter_keys: TANS tau and step, Adam's step) as Python ints, one list of k
             per key: the host reads them without touching the device; saved as 0-dim int64 tensors per matrix
  index      sparse groups: int32 [k, r * c], row i the flat kept index (distsparse.nm.kept_index) of member i's
             current codes. A cache (4 B per value): a row is rebuilt when its module's codes tensor is replaced
             or written (its version counter moved), checked on the host each step; `step_index()` hands the
             kernel one int64 copy per group and step
  pruned     groups of rules that need the support (`needs_support_mask`, CAST's AdamS): bool [k, out, in], the
             complement of each member's current mask, cached by codes version where the module holds codes and
             rebuilt every step where it does not
Per-matrix views of master and slots (`master_views`, `slot_views`) alias the rows; they are made once, so a step
issues no per-matrix op. Elastic resume re-forms the groups from the new owner map and loads rows by name.
Pure tensor storage: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from distsparse.nm import kept_index
from distsparse.optim.rules import Rule

if TYPE_CHECKING:
    from distsparse.optim.engine import Matrix

COUNTER_DTYPE = torch.int64   # how a counter is saved (rules.init_state's 0-dim CPU tensors)


@dataclass(frozen=True)
class GroupKey:
    values_shape: tuple[int, int]   # the parameter's shape: [out, kept] (sparse) or [out, in] (dense)
    frame: tuple[int, int]          # the dense frame (out, in) Newton-Schulz runs on
    sparse: bool                    # has a kept index (compressed values) or not (dense, dense latents)
    dtype: torch.dtype              # the parameter's dtype (the masters are fp32 either way)


def group_key(m: Matrix) -> GroupKey:
    return GroupKey(tuple(m.param.shape), m.shape, m.sparse, m.param.dtype)


class MatrixGroup:
    """k same-key matrices: stacked master and rule state, host counters, cached index or support complement."""

    def __init__(self, key: GroupKey, members: list[Matrix], rule: Rule, device: torch.device,
                 initial: dict[str, torch.Tensor] | None, grad_views: list[torch.Tensor]):
        k = len(members)
        self.key, self.members, self.frame = key, members, key.frame
        self.names = [m.name for m in members]
        self.rows = {name: i for i, name in enumerate(self.names)}
        self.master = torch.empty(k, *key.values_shape, dtype=torch.float32, device=device)
        for i, m in enumerate(members):   # once, at build
            init = initial[m.name] if initial else m.param.detach()
            self.master[i].copy_(init.reshape(key.values_shape))
        self.slots = {s: torch.zeros(k, *key.values_shape, dtype=torch.float32, device=device)
                      for s in rule.slot_keys}
        self.counters: dict[str, list[int]] = {c: [0] * k for c in rule.counter_keys}
        self.master_views = list(self.master.unbind(0))
        self.slot_views = {s: list(t.unbind(0)) for s, t in self.slots.items()}
        self.params = [m.param for m in members]
        self.grad_views = grad_views                  # [r, c] views of each member's reduced gradient
        self.index = (torch.empty(k, key.values_shape[0] * key.values_shape[1], dtype=torch.int32, device=device)
                      if key.sparse else None)
        self.pruned = (torch.empty(k, *key.frame, dtype=torch.bool, device=device)
                       if rule.needs_support_mask else None)
        self._index_seen: list[tuple | None] = [None] * k
        self._pruned_seen: list[tuple | None] = [None] * k

    def __len__(self) -> int:
        return len(self.members)

    # ---- per step ----------------------------------------------------------------------------------------

    def stacked_grads(self) -> torch.Tensor:
        """fp32 [k, r, c]: a copy of the members' reduced gradients (the kernel may scale it in place)."""
        return torch.stack(self.grad_views)

    def step_index(self) -> torch.Tensor | None:
        """int64 [k, r * c] kept indices of the current codes (rows rebuilt where codes changed), or None (dense)."""
        if self.index is None:
            return None
        for i, m in enumerate(self.members):
            if _changed(self._index_seen, i, m.module.codes):
                self.index[i].copy_(kept_index(m.module.meta))
        return self.index.long()

    def support_complement(self) -> torch.Tensor:
        """bool [k, out, in]: True where each member's current support mask is False."""
        for i, m in enumerate(self.members):
            codes = getattr(m.module, "codes", None)
            if codes is None or _changed(self._pruned_seen, i, codes):
                torch.logical_not(m.module.current_mask(), out=self.pruned[i])
        return self.pruned

    # ---- one matrix at a time (refresh, checkpoints) -----------------------------------------------------

    def state_of(self, row: int) -> dict[str, torch.Tensor]:
        """Matrix `row`'s rule state as rules.init_state lays it out: views of the slot rows, 0-dim CPU counters."""
        state = {s: views[row] for s, views in self.slot_views.items()}
        state.update({c: torch.tensor(values[row], dtype=COUNTER_DTYPE, device="cpu")
                      for c, values in self.counters.items()})
        return state

    def set_row(self, row: int, master: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Write one matrix's master and rule state (as state_of lays it out) into its row."""
        self.master_views[row].copy_(master.reshape(self.key.values_shape))
        for s, views in self.slot_views.items():
            views[row].copy_(state[s].reshape(self.key.values_shape))
        for c, values in self.counters.items():
            values[row] = int(state[c])

    def state_bytes(self) -> int:
        """Masters and slot tensors (storage bytes) plus the counters at their saved size (8 B each)."""
        tensors = [self.master, *self.slots.values()]
        counters = sum(len(v) for v in self.counters.values()) * COUNTER_DTYPE.itemsize
        return sum(t.untyped_storage().nbytes() for t in tensors) + counters

    def cache_bytes(self) -> int:
        """The derived caches: the int32 kept index and the support complement."""
        return sum(t.untyped_storage().nbytes() for t in (self.index, self.pruned) if t is not None)


def _changed(seen: list[tuple | None], i: int, codes: torch.Tensor) -> bool:
    """True (and remembered) when `codes` is another tensor or was written since row i was last built."""
    now = (codes, codes._version)   # the version counter moves on every in-place write (set_codes, load, copy_)
    before = seen[i]
    if before is not None and before[0] is codes and before[1] == now[1]:
        return False
    seen[i] = now
    return True


def form_groups(matrices: list[Matrix], rule: Rule, device: torch.device, initial: dict[str, torch.Tensor] | None,
                grad_view) -> list[MatrixGroup]:
    """The groups of `matrices` (module docstring); `grad_view(matrix)` is its [r, c] reduced-gradient view."""
    members: dict[GroupKey, list[Matrix]] = {}
    for m in sorted(matrices, key=lambda m: m.name):
        members.setdefault(group_key(m), []).append(m)
    return [MatrixGroup(key, ms, rule, device, initial, [grad_view(m) for m in ms]) for key, ms in members.items()]
