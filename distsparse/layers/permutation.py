"""`BlockPermutation`: the learned block-diagonal input permutation of ShuffleSparse (seed s3.1-3.2, 3.4, App. E;
DESIGN s4 decision 12 and s5; research/permutations_pruning.md s1, s2, s8.A, s9). The math lives in
permutation_math.py; this file owns the module, its hardening state and the gather Function.

Convention (research s9): y = Pi x on the last dim with Pi[i, j] = 1 meaning y_i = x_j, so a hard Pi is
`y = x[..., perm]` with perm[i] = j. Pi is block-diagonal: block k maps features [k*b, (k+1)*b) to themselves.

Shape legend: T leading dims (any), d features, b block size, nb = d / b blocks, ns soft blocks.

    soft block k:  M_k = doubly_stochastic(theta_k)                 [b, b]   (fp32, Sinkhorn + exact closure)
                   y[..., k, :] = M_k @ x[..., k, :]                [T, b]   (per-block einsum: O(d b) per row)
    hard block k:  y[k*b:(k+1)*b] = x[hard_perm[k*b:(k+1)*b]]      (gather, no multiply)
    all hard:      y = x[..., hard_perm]                             (one gather; backward gathers with inv)

Projections that read one input share one module (q/k/v, gate/up) and call it with the same tensor; the module
keeps its last (input, output) pair while the input object lives, so the second and third calls return the first
output: one gather or block product per input, and one backward for it, instead of one per projection. Likewise
`penalty()` reuses the doubly stochastic blocks of the last forward instead of running Sinkhorn again.

Training under ZeRO: DeepSpeed keeps its own fp32 master of theta and updates it with AdamW, so the layer
never projects theta in place; any theta maps to doubly stochastic blocks inside the forward. theta keeps
requires_grad=True for the whole run (a parameter leaving DeepSpeed's partitions mid-run is not supported);
a hardened block is read neither by the forward nor by the penalty, so its gradient is exactly zero, and
once every block is hard theta is not read at all (ZeRO-1/2 fills the missing grad with zeros under its
default `ignore_unused_parameters: true`; torch AdamW skips a None grad). AdamW momentum and weight decay may
still move a hardened block's theta, which nothing reads again: `hard_mask` and `hard_perm` are the state.
Put theta in a parameter group without weight decay (research s1); Sinkhorn is scale-invariant anyway.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from distsparse.layers.permutation_math import (
    block_offsets, doubly_stochastic, hungarian, inverse_permutation, l1_l2_penalty, per_row_penalty,
    permutation_matrix_from_indices,
)
from distsparse.layers.permutation_math import distance_from_identity as _distance_from_identity

MODES = ("identity", "random", "learned")


class PermuteLastDim(torch.autograd.Function):
    """y = x[..., perm]; the backward is the gather by the inverse permutation (no zero fill, no scatter-add).

    `gather` with the index broadcast over the leading dims, not `index_select(-1, ...)`: on CPU the latter copies
    element by element along the last dim and measured 5x slower ([1024, 512] fp32, one thread: 2.2 ms vs 0.4 ms).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return x.gather(-1, perm.expand(x.shape))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return grad_y.gather(-1, inv.expand(grad_y.shape)), None, None


class _ReuseSlot:
    """One remembered tensor and the key it is valid for. It is forgotten on `clear`, when backward passes through
    it (backward frees the graph behind it, so a later call must build a new one), and when `watch`, if given, is
    freed. The callbacks hold weak references only, so the tensor's hook keeps neither the tensor nor the slot
    alive."""

    def __init__(self) -> None:
        self._entry: tuple | None = None     # (key, value, token, weakref to the watched object or None)

    def get(self, key: tuple) -> torch.Tensor | None:
        return self._entry[1] if self._entry is not None and self._entry[0] == key else None

    def put(self, key: tuple, value: torch.Tensor, watch: torch.Tensor | None = None) -> None:
        slot, token = weakref.ref(self), object()

        def forget(_=None) -> None:
            owner = slot()
            if owner is not None and owner._entry is not None and owner._entry[2] is token:
                owner._entry = None

        self._entry = (key, value, token, None if watch is None else weakref.ref(watch, forget))
        if value.requires_grad:
            value.register_hook(forget)

    def clear(self) -> None:
        self._entry = None


def _block_matmul(x_blocks: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """y[..., k, i] = sum_j blocks[k, i, j] x[..., k, j]; x_blocks [T, n, b], blocks [n, b, b]."""
    return torch.einsum("...kj,kij->...ki", x_blocks, blocks.to(x_blocks.dtype))


class BlockPermutation(nn.Module):
    """y = Pi x on the last dim, Pi block-diagonal with `block_size` blocks (memory O(d b), not O(d^2)).

    Modes (the seed's controls): `identity` (forward returns x), `random` (a block-diagonal permutation drawn
    from `seed`, one gather), `learned` (theta [nb, b, b]; soft blocks until hardened by Hungarian matching).
    Persistent buffers `hard_mask` [nb] bool and `hard_perm` [d] int64 hold the hardening state, so it lands
    in the module state_dict and DeepSpeed's checkpoint; change them only through `harden` or
    `load_state_dict` (both refresh the cached block routing).
    """

    def __init__(self, d: int, block_size: int, mode: str = "learned", *, seed: int = 0,
                 init_mix: float = 0.5, init_noise: float = 0.01, sinkhorn_iters: int = 5,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}; allowed: {', '.join(MODES)}")
        if d <= 0 or block_size <= 0 or d % block_size != 0:
            raise ValueError(f"block_size: got {block_size} for d={d}; allowed: a positive divisor of d")
        if not 0.0 <= init_mix <= 1.0:
            raise ValueError(f"init_mix: got {init_mix}; allowed: 0 <= init_mix <= 1")
        if init_noise < 0:
            raise ValueError(f"init_noise: got {init_noise}; allowed: init_noise >= 0")
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters: got {sinkhorn_iters}; allowed: sinkhorn_iters >= 1")
        self.d, self.block_size, self.num_blocks, self.mode = d, block_size, d // block_size, mode
        self.seed, self.init_mix, self.init_noise, self.sinkhorn_iters = seed, init_mix, init_noise, sinkhorn_iters
        if mode == "learned":
            self.theta = nn.Parameter(torch.empty(self.num_blocks, block_size, block_size, device=device,
                                                  dtype=dtype))
        else:
            self.register_parameter("theta", None)
        self.register_buffer("hard_mask", torch.zeros(self.num_blocks, dtype=torch.bool, device=device))
        self.register_buffer("hard_perm", torch.zeros(d, dtype=torch.int64, device=device))
        # Derived from the buffers (rebuilt lazily): soft block ids and the inverse of hard_perm. Kept off the
        # state_dict, and cached so the forward does not sync with the device to find the soft blocks.
        self._routing: tuple[torch.Tensor, torch.Tensor] | None = None
        # The last output and the last soft blocks, for the calls that may reuse them (module docstring).
        self._last_output, self._last_blocks = _ReuseSlot(), _ReuseSlot()
        if self.hard_perm.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh state drawn from a generator seeded by `seed` (the same layer on every rank).

        learned: theta = (1 - init_mix) I + init_mix / b + init_noise * U(0, 1) per block (research s8.A): the
        identity leads every row, yet the block is well inside the Birkhoff polytope, so Sinkhorn converges in
        a few rounds and no block starts near delta = 0.22 (per-row penalty 0.60 at b = 64 and 0.34 at b = 4
        with the defaults; identity + small noise alone would start at 0.24 at b = 64 and harden at once).
        random: each block a uniform permutation. All blocks of identity and random modes start hard.
        """
        gen = torch.Generator().manual_seed(self.seed)
        nb, b = self.num_blocks, self.block_size
        arange = torch.arange(self.d, dtype=torch.int64)
        if self.mode == "learned":
            theta = (1.0 - self.init_mix) * torch.eye(b) + self.init_mix / b
            theta = theta + self.init_noise * torch.rand(nb, b, b, generator=gen)
            self.theta.copy_(theta)
            self.hard_mask.fill_(False)
            self.hard_perm.copy_(arange)
        elif self.mode == "random":
            self.hard_mask.fill_(True)
            self.hard_perm.copy_(block_offsets(torch.rand(nb, b, generator=gen).argsort(-1)))
        else:
            self.hard_mask.fill_(True)
            self.hard_perm.copy_(arange)
        self._state_changed()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._state_changed()

    def _state_changed(self) -> None:
        self._routing = None
        self._last_output.clear()
        self._last_blocks.clear()

    def __getstate__(self) -> dict:
        # The reuse slots hold weakrefs and live activations: neither belongs in a copy or a pickle.
        return {**self.__dict__, "_last_output": _ReuseSlot(), "_last_blocks": _ReuseSlot(), "_routing": None}

    def _soft_ids_and_inverse(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._routing is None or self._routing[0].device != self.hard_mask.device:
            soft_ids = (~self.hard_mask).nonzero().squeeze(1)      # the one device sync, after a state change
            self._routing = (soft_ids, inverse_permutation(self.hard_perm))
            self._last_output.clear()                               # also after a move to another device
            self._last_blocks.clear()
        return self._routing

    def soft_blocks(self, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [n, b, b] doubly stochastic blocks of theta (all blocks, or `block_ids`), with autograd."""
        assert self.theta is not None, f"soft_blocks needs mode 'learned', not {self.mode!r}"
        theta = self.theta if block_ids is None else self.theta.index_select(0, block_ids)
        return doubly_stochastic(theta, self.sinkhorn_iters)

    def _theta_key(self) -> tuple:
        return (-1 if self.theta is None else self.theta._version, torch.is_grad_enabled())

    def _forward_soft_blocks(self, soft_ids: torch.Tensor) -> torch.Tensor:
        """soft_blocks(soft_ids), always computed (an activation-checkpointing recompute must save what the first
        forward saved), and kept for `penalty()` when built with autograd."""
        blocks = self.soft_blocks(None if soft_ids.numel() == self.num_blocks else soft_ids)
        if blocks.requires_grad:
            self._last_blocks.put((id(soft_ids), *self._theta_key()), blocks)
        return blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "identity":
            return x
        # Reusable while x is the same unmodified tensor (the slot watches x, so its id is not recycled meanwhile),
        # theta is unchanged and the grad mode is the same.
        key = (id(x), -1 if x.is_inference() else x._version, *self._theta_key())
        y = self._last_output.get(key)
        if y is None:
            y = self._permute(x)
            self._last_output.put(key, y, watch=x)
        return y

    def _permute(self, x: torch.Tensor) -> torch.Tensor:
        soft_ids, inv = self._soft_ids_and_inverse()
        if soft_ids.numel() == 0:
            return PermuteLastDim.apply(x, self.hard_perm, inv)
        x_blocks = x.unflatten(-1, (self.num_blocks, self.block_size))     # [T, nb, b]
        if soft_ids.numel() == self.num_blocks:
            return _block_matmul(x_blocks, self._forward_soft_blocks(soft_ids)).flatten(-2)
        # Mixed: gather everything (soft blocks' hard_perm entries are the identity), then overwrite the soft
        # blocks with their products; only soft blocks read theta, so hard blocks get exactly zero gradient.
        y_blocks = PermuteLastDim.apply(x, self.hard_perm, inv).unflatten(-1, (self.num_blocks, self.block_size))
        y_soft = _block_matmul(x_blocks.index_select(-2, soft_ids), self._forward_soft_blocks(soft_ids))
        return y_blocks.index_copy(-2, soft_ids, y_soft).flatten(-2)

    def penalty(self) -> torch.Tensor:
        """Scalar sum of the l1 - l2 penalty (seed Eq. 2) over the soft blocks, unscaled and differentiable;
        the loss adds perm_lambda(step, ...) * penalty(). Zero once every block is hard."""
        soft_ids, _ = self._soft_ids_and_inverse()
        if soft_ids.numel() == 0:
            return torch.zeros((), device=self.hard_mask.device)
        # The last forward's blocks while theta, the soft set and the grad mode are unchanged and no backward has
        # passed through them; only blocks built with autograd are kept, and backward always ends their life (an
        # update of theta through `.data`, as DeepSpeed's, leaves theta._version unchanged).
        blocks = self._last_blocks.get((id(soft_ids), *self._theta_key()))
        return l1_l2_penalty(self.soft_blocks(soft_ids) if blocks is None else blocks).sum()

    @torch.no_grad()
    def penalty_per_row(self) -> torch.Tensor:
        """fp32 [nb]: each block's penalty divided by its 2b rows and columns (0 for hard blocks)."""
        out = torch.zeros(self.num_blocks, device=self.hard_mask.device)
        soft_ids, _ = self._soft_ids_and_inverse()
        if soft_ids.numel() > 0:
            out[soft_ids] = per_row_penalty(self.soft_blocks(soft_ids))
        return out

    @torch.no_grad()
    def harden_ready(self, delta: float) -> torch.Tensor:
        """bool [nb]: soft blocks whose per-row penalty is below `delta` (seed App. E.1 uses 0.22)."""
        if delta <= 0:
            raise ValueError(f"delta: got {delta}; allowed: delta > 0 (the per-row penalty is >= 0)")
        return ~self.hard_mask & (self.penalty_per_row() < delta)

    @torch.no_grad()
    def harden(self, blocks: torch.Tensor) -> None:
        """Harden the soft blocks selected by the bool mask `blocks` [nb] (hard ones are left as they are):
        each becomes the permutation maximizing <Pi, M_k> (seed Eq. 7), then an index gather."""
        assert blocks.dtype == torch.bool and blocks.shape == (self.num_blocks,), (blocks.dtype, blocks.shape)
        block_ids = (blocks.to(self.hard_mask.device) & ~self.hard_mask).nonzero().squeeze(1)
        if block_ids.numel() == 0:
            return
        local = hungarian(self.soft_blocks(block_ids)).to(block_ids.device)        # [n, b]
        perm = local + block_ids.unsqueeze(1) * self.block_size
        self.hard_perm.view(self.num_blocks, self.block_size)[block_ids] = perm
        self.hard_mask[block_ids] = True
        self._state_changed()

    def harden_all(self) -> None:
        """Harden every remaining soft block (called at T_perm)."""
        self.harden(~self.hard_mask)

    def all_hard(self) -> bool:
        """True once every block is hard (identity and random modes always; forward is then one gather)."""
        return self._soft_ids_and_inverse()[0].numel() == 0

    def perm_indices(self) -> torch.Tensor:
        """int64 [d] perm with y = x[..., perm]; only once every block is hard."""
        if not self.all_hard():
            raise RuntimeError(f"perm_indices: {int((~self.hard_mask).sum())} of {self.num_blocks} blocks are "
                               "still soft; call harden_all() first")
        return self.hard_perm.clone()

    def inverse_indices(self) -> torch.Tensor:
        """int64 [d] inv with inv[perm[i]] = i (so W Pi = W[:, inv], research s0 item 3)."""
        return inverse_permutation(self.perm_indices())

    @torch.no_grad()
    def projected_indices(self) -> torch.Tensor:
        """int64 [d]: hard blocks as stored, soft blocks projected by Hungarian matching (state unchanged)."""
        perm = self.hard_perm.clone()
        soft_ids, _ = self._soft_ids_and_inverse()
        if soft_ids.numel() > 0:
            local = hungarian(self.soft_blocks(soft_ids)).to(perm.device)
            perm.view(self.num_blocks, self.block_size)[soft_ids] = local + soft_ids.unsqueeze(1) * self.block_size
        return perm

    @torch.no_grad()
    def permutation_matrix(self) -> torch.Tensor:
        """fp32 dense [d, d] of the current operator (soft blocks included): forward(x) == x @ P^T.
        For tests and small d only."""
        dense = permutation_matrix_from_indices(self.hard_perm)
        soft_ids, _ = self._soft_ids_and_inverse()
        if soft_ids.numel() > 0:
            b = self.block_size
            for block_id, block in zip(soft_ids.tolist(), self.soft_blocks(soft_ids)):
                dense[block_id * b:(block_id + 1) * b, block_id * b:(block_id + 1) * b] = block
        return dense

    def distance_from_identity(self) -> float:
        """1 - ||Pi - I||_F / sqrt(2d) (seed s5.3) of `projected_indices()`: soft blocks are projected to
        their Hungarian permutation first, as the seed does. 1 at the identity, 0 when every index moves."""
        return _distance_from_identity(self.projected_indices())

    def fraction_hardened(self) -> float:
        return self.hard_mask.float().mean().item()

    def metrics(self) -> dict[str, float]:
        """TensorBoard scalars of one layer (issue 8 item 5): unscaled penalty, fraction of hard blocks,
        distance from identity."""
        with torch.no_grad():
            penalty = self.penalty().item()
        return {"penalty": penalty, "fraction_hardened": self.fraction_hardened(),
                "distance_from_identity": self.distance_from_identity()}

    def extra_repr(self) -> str:
        return (f"d={self.d}, block_size={self.block_size}, mode={self.mode}, "
                f"sinkhorn_iters={self.sinkhorn_iters}")
