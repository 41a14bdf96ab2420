"""`NMSparseLinear`: a linear layer whose weight exists only as compressed N:M values plus codes.

Shape legend: T tokens (any leading dims), I in_features, O out_features, K = I * N / 4 kept per row, G = I / 4.

    forward:   key = int32(codes)                    (saved for backward: 4 B per code byte)
               W = decompress_groups(values, key)    [O, I] (saved for backward, freed after it)
                 N = 1: values x one_hot_table[key]    one-hot rows [O, G, 1, 4], transient: one mul
                 N > 1: zeros.scatter(pos, values)     pos = table[key], int64 [O, G, N], transient
               y = x @ W^T (+ b)                     [T, O]
    backward:  pos = table[key]                      (W and key are the forward's: no second decompression, no cast)
               grad_x      = g @ W                   [T, I]
               grad_values = gather(g^T @ x, pos)    [O, K]  (only kept positions leave the Function)

Activation memory (issue 25): W is held from forward to backward, one dense weight per projection in the weight
dtype (at 350m, 24 x (4 x 1024^2 + 3 x 1024 x 2736) x 2 B = 0.60 GB of bf16 backbone weights at once, beside tens of
GB of activations); between calls a layer still holds its values and codes only (issue 19: an index cache was 4 B
per kept value, more than the bf16 values). Training executes dense GEMMs on the decompressed weight (DESIGN s6):
the wins are memory, optimizer state and communication; speed comes from 2:4 kernels at inference.

Launches (issue 25 item 2): the positions come from a lookup table from code bytes (row-wise) or motif ids (block-
wise) to positions inside each group of 4 columns, and W is one scatter into the matrix viewed as groups (at N = 1
one multiply by the same table as one-hot rows: as many bytes at bf16 as the int64 positions, one kernel fewer); no
flat index is computed. The lookup's key is the codes cast to int32 (an embedding takes no uint8 index), cast once
in forward and saved for backward's lookup: 4 B per code byte held from forward to backward (1/8 of a bf16 W, 1/4
at 2:4 row-wise; the codes themselves are saved anyway), for one launch fewer per call (on an H200 the launches, not the
bytes, are what the lookups cost: 336 calls per 350m step). Forward + backward (tools/bench_layer.py's count,
views included) dispatch 16 aten ops at 1:4 row-wise (7 of them kernels), 17 at 2:4, block-wise 18 and 19, against
nn.Linear's 7 (2.3-2.7x; one op more each with a cast per lookup), where rebuilding the flat int64 index (row * I +
group offset + table entry) took 5.3-6.1x. Not taken: the positions themselves (or one index derived once per step)
shared by forward and backward: kept in the module it is 8 B per kept value between calls (4x the bf16 values,
against the memory target) and needs invalidating at every refresh, `set_codes`, checkpoint load and in-place
all-gather of the codes; saved in the Function it stays alive from forward to backward in every layer at once (at
1:4 the size of the dense bf16 weight), while the embedding it would save in backward is 1 kernel. Nothing is
cached between calls, so activation checkpointing re-runs the same forward (DESIGN decision 16)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distsparse.nm import (
    NMMeta, NMSpec, codes_shape, decompress, decompress_groups, encode, gather_groups, is_legal, kept_index,
    kept_positions, lookup_key, random_mask,
)

INIT_MODES = ("swi", "hf")


class NMLinearFunction(torch.autograd.Function):
    """y = x @ decompress(values)^T + b; saves x, the decompressed weight W, the codes and their int32 lookup key:
    backward multiplies by the forward's W instead of scattering it again, and looks the positions up from the key
    for the gather of the weight gradient, so no index-sized tensor is saved. Saving the codes also lets autograd
    refuse a backward after the codes changed in place (a topology installed mid-step)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, values: torch.Tensor, codes: torch.Tensor, spec: NMSpec,
                in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        shape = (values.shape[0], in_features)
        key = lookup_key(codes)
        weight = decompress_groups(values, NMMeta(codes, spec, shape), key)
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
            positions = kept_positions(NMMeta(codes, ctx.spec, tuple(weight.shape)), key)
            grad_w = grad_y2.t() @ x.flatten(0, -2).to(grad_y2.dtype)
            grad_values = gather_groups(grad_w, positions, ctx.kept).to(weight.dtype)
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
