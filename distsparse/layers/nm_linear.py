"""`NMSparseLinear`: a linear layer whose weight exists only as compressed N:M values plus codes.

Shape legend: T tokens (any leading dims), I in_features, O out_features, K = I * N / 4 kept per row, G = I / 4.

    forward:   key = table row of every kept slot    int32 [O * K] (one add on the codes), saved for backward
               W   = embedding_bag(table, key, values)  [O, I] (one kernel; saved for backward, freed after it)
               y   = x @ W^T (+ b)                    [T, O]
    backward:  grad_x      = g @ W                    [T, I]   (W is the forward's: no second decompression)
               grad_values = <g^T @ x, table[key]>    [O, K]   (embedding_bag's per-sample-weights gradient, one
                                                               kernel: only kept positions leave the Function)
(distsparse/nm/storage.py, "bags": each table row is the one-hot of a slot's column in its span of whole groups.)
Shapes whose last code byte per row has padding slots (I not a multiple of 16 / N) use the group lookup instead:
key = int32(codes), W = values x one_hot_table[key] (N = 1) or zeros.scatter(table[key], values), grad_values =
gather(g^T @ x, table[key]).

Activation memory (issue 25): W is held from forward to backward, one dense weight per projection in the weight
dtype (at 350m, 24 x (4 x 1024^2 + 3 x 1024 x 2736) x 2 B = 0.60 GB of bf16 backbone weights at once, beside tens of
GB of activations), and beside it the key, 4 B per kept value (half a bf16 W at 1:4, a whole one at 2:4: 0.30 GB at
350m 1:4); between calls a layer still holds its values and codes only (issue 19: an index cache was 4 B per kept
value, more than the bf16 values). Training executes dense GEMMs on the decompressed weight (DESIGN s6): the wins
are memory, optimizer state and communication; speed comes from 2:4 kernels at inference.

Launches (issue 25 item 2; on an H200 the launches, not the bytes, are what the decompression and the gather cost:
336 calls per 350m step, every one launch-bound): the key (a uint8 + int32 add, no separate cast), W (one embedding
bag) and grad_values (one kernel) are 3 launches beside nn.Linear's GEMMs, where a positions lookup (cast,
embedding) with a multiply or scatter forward and a lookup and gather backward took 5-6. Forward + backward
(bench/layer.py's count, views included) dispatch 15 aten ops at 1:4 row-wise, 5 of them kernels, and as many at 2:4
and block-wise, against nn.Linear's 7 (2.1x; 2.4-2.9x with the positions lookup), where rebuilding the flat int64
index (row * I + group offset + table entry) took 5.3-6.1x. The key is saved rather than rebuilt in backward (one
launch per call, 168 x 2 per 350m step, for 4 B per kept value held from forward to backward); the table and the
bags' offsets are per shape and device, cached like the lookup tables. Not taken: one index derived once per step
and kept in the module: it is 4-8 B per kept value between calls (2-4x the bf16 values, against the memory target)
and needs invalidating at every refresh, `set_codes`, checkpoint load and in-place all-gather of the codes. Nothing
is cached per layer, so activation checkpointing re-runs the same forward (DESIGN decision 16)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsparse.nm import (
    NMMeta, NMSpec, bag_key, bags_tile, codes_shape, decompress, decompress_bags, decompress_groups, encode,
    gather_bags, gather_groups, is_legal, kept_index, kept_positions, lookup_key, random_mask,
)

INIT_MODES = ("swi", "hf")


class NMLinearFunction(torch.autograd.Function):
    """y = x @ decompress(values)^T + b; saves x, the decompressed weight W, the codes and the key W was built from:
    backward multiplies by the forward's W instead of building it again, and gathers the weight gradient through
    the same key (module docstring). Saving the codes also lets autograd refuse a backward after the codes changed
    in place (a topology installed mid-step)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, values: torch.Tensor, codes: torch.Tensor, spec: NMSpec,
                in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        meta = NMMeta(codes, spec, (values.shape[0], in_features))
        if bags_tile(meta):
            key = bag_key(meta)
            weight = decompress_bags(values, meta, key)
        else:   # padding slots in the last code byte of each row (module docstring)
            key = lookup_key(codes)
            weight = decompress_groups(values, meta, key)
        ctx.save_for_backward(x, weight, codes, key)
        ctx.spec, ctx.kept = spec, values.shape[1]
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, codes, key = ctx.saved_tensors
        grad_x = grad_values = grad_bias = None
        grad_y2 = grad_y.flatten(0, -2)   # [T, O]; flatten returns 2-D tensors as they are, without an op
        if ctx.needs_input_grad[0]:
            grad_x = grad_y @ weight   # matmul keeps the leading dims
        if ctx.needs_input_grad[1]:
            meta = NMMeta(codes, ctx.spec, tuple(weight.shape))
            grad_w = grad_y2.t() @ x.flatten(0, -2).to(grad_y2.dtype)
            if bags_tile(meta):
                grad_values = gather_bags(grad_w, meta, key)
            else:
                grad_values = gather_groups(grad_w, kept_positions(meta, key), ctx.kept)
            grad_values = grad_values.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[5]:
            grad_bias = grad_y2.sum(0)
        return grad_x, grad_values, None, None, None, grad_bias


class NMSparseLinear(nn.Module):
    """Drop-in for `nn.Linear` with an N:M sparse weight held as `values` [O, K] + `codes` (uint8 buffer), and
    nothing else: the flat index is derived from the codes wherever it is needed (`index`), so `set_codes`,
    `load_state_dict`, a collective writing into the buffer and a device move need no invalidation."""

    def __init__(self, in_features: int, out_features: int, spec: NMSpec, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 init: str = "swi", init_std: float = 0.02, seed: int = 0):
        super().__init__()
        spec.check_shape(out_features, in_features)
        if init not in INIT_MODES:
            raise ValueError(f"init: got {init!r}; allowed: {', '.join(INIT_MODES)}")
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.init, self.init_std, self.seed = init, init_std, seed
        kept = spec.kept_per_row(in_features)
        self.values = nn.Parameter(torch.empty(out_features, kept, device=device, dtype=dtype))
        self.register_buffer("codes", torch.zeros(codes_shape(spec, out_features, in_features),
                                                  dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        if self.values.device.type != "meta":
            self.reset_parameters()

    @property
    def meta(self) -> NMMeta:
        return NMMeta(self.codes, self.spec, (self.out_features, self.in_features))

    @property
    def index(self) -> torch.Tensor:
        """int64 [O * K] flat kept index, derived from the codes on every access (a transient: not stored)."""
        return kept_index(self.meta)

    def init_std_value(self) -> float:
        """SWI: N(0, 2 / (density * fan_in)) (sparse weight init); hf: the model's initializer_range."""
        if self.init == "swi":
            return math.sqrt(2.0 / (self.spec.density * self.in_features))
        return self.init_std

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A uniformly random legal mask and fresh values, both drawn from a generator seeded by `seed`,
        so materializing from the meta device gives the same layer on every rank."""
        gen = torch.Generator().manual_seed(self.seed)
        mask = random_mask(self.out_features, self.in_features, self.spec, gen)
        self.set_codes(encode(mask, self.spec).codes.to(self.codes.device))
        vals = torch.randn(self.values.shape, generator=gen) * self.init_std_value()
        self.values.copy_(vals.to(self.values.dtype))
        if self.bias is not None:
            self.bias.zero_()

    @torch.no_grad()
    def set_codes(self, codes: torch.Tensor) -> None:
        """Install a new topology (values must be moved by the caller)."""
        meta = NMMeta(codes, self.spec, (self.out_features, self.in_features))
        assert is_legal(meta), f"illegal codes for {self.spec} {meta.shape}"
        self.codes.copy_(codes)

    def dense_weight(self) -> torch.Tensor:
        """The decompressed [O, I] weight (for export and tests; never used in training)."""
        return decompress(self.values.detach(), self.meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NMLinearFunction.apply(x, self.values, self.codes, self.spec, self.in_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, sparsity={self.spec}"
