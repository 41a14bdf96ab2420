"""Compressed N:M storage: kept values plus packed index metadata (DESIGN s3).

Shapes (W is [out, in], k = in * N / 4 kept values per output row):
  values  [out, k]          kept weights of each row in column order (same for both layouts, since a
                            transposable block also keeps N per row)
  codes   row-wise:   uint8 [out, ceil(k / 4)]  2-bit position inside its group of each kept value,
                            four per byte, first value in the low bits (NVIDIA's 2:4 convention)
          block-wise: uint8 [out / 4, in / 4]   motif id (index into `block_motifs(N)`) of each 4x4 block

Values + codes are everything a matrix holds (issue 19). Two transients are derived from the codes per call and
dropped, never cached (8 B per kept value, 4x the bf16 values they address):
  `kept_positions`  position of each kept value inside its group of 4 columns: one table lookup per code byte or
                    block and nothing else, for `scatter_groups` / `gather_groups` (decompress and the gather of a
                    gradient in the layer's forward and backward: a handful of kernels, issue 25); its key, the
                    codes cast to int32 (`lookup_key`, 4 B per code byte), can be cast once for two lookups
  `kept_index`      the flat position in [out, in]: the lookup plus row and group offsets, for callers that need
                    flat positions (slot maps, refresh, the optimizer rules' scatter and gather)
Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distsparse.nm.patterns import M, block_motifs, motif_ids, row_patterns
from distsparse.nm.spec import NMSpec

_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


@dataclass
class NMMeta:
    """Index metadata of one compressed matrix: packed codes, the pattern spec and the dense shape."""
    codes: torch.Tensor
    spec: NMSpec
    shape: tuple[int, int]

    @property
    def kept_per_row(self) -> int:
        return self.spec.kept_per_row(self.shape[1])


def codes_shape(spec: NMSpec, out_features: int, in_features: int) -> tuple[int, int]:
    if spec.layout == "block":
        return (out_features // M, in_features // M)
    return (out_features, -(-spec.kept_per_row(in_features) // 4))


def _check_mask_shape(mask: torch.Tensor, spec: NMSpec) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask: expected a 2-D [out, in] tensor, got shape {tuple(mask.shape)}")
    spec.check_shape(*mask.shape, name="mask")


def _to_blocks(x: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/4, in/4, 4, 4]."""
    out_f, in_f = x.shape
    return x.reshape(out_f // M, M, in_f // M, M).transpose(1, 2)


def _from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[out/4, in/4, 4, 4] -> [out, in]."""
    bo, bi = blocks.shape[:2]
    return blocks.transpose(1, 2).reshape(bo * M, bi * M)


def group_counts_ok(mask: torch.Tensor, spec: NMSpec) -> bool:
    """True when every row group (and, block-wise, every block column) keeps exactly N."""
    out_f, in_f = mask.shape
    if not bool((mask.reshape(out_f, in_f // M, M).sum(-1) == spec.n).all()):
        return False
    if spec.layout == "block":
        return bool((_to_blocks(mask).sum(-2) == spec.n).all())
    return True


def encode(mask: torch.Tensor, spec: NMSpec) -> NMMeta:
    """Bool mask [out, in] -> NMMeta. Raises ValueError if the mask is not a legal `spec` pattern."""
    _check_mask_shape(mask, spec)
    mask = mask.bool()
    if not group_counts_ok(mask, spec):
        raise ValueError(f"mask is not a legal {spec} pattern: some group or block does not keep exactly {spec.n}")
    out_f, in_f = mask.shape
    if spec.layout == "block":
        codes = motif_ids(_to_blocks(mask), spec.n).to(torch.uint8)
        return NMMeta(codes, spec, (out_f, in_f))
    k = spec.kept_per_row(in_f)
    cols = mask.nonzero()[:, 1].view(out_f, k)   # row-major nonzero: kept columns of each row, ascending
    pos = (cols % M).to(torch.uint8)
    pad = (-k) % 4
    if pad:
        pos = torch.cat([pos, pos.new_zeros(out_f, pad)], dim=1)
    packed = (pos.view(out_f, -1, 4) << _SHIFTS.to(pos.device)).sum(-1, dtype=torch.uint8)
    return NMMeta(packed, spec, (out_f, in_f))


def _row_positions(meta: NMMeta) -> torch.Tensor:
    """Unpacked 2-bit positions, int64 [out, k]."""
    out_f = meta.shape[0]
    pos = (meta.codes.unsqueeze(-1) >> _SHIFTS.to(meta.codes.device)) & 3
    return pos.view(out_f, -1)[:, : meta.kept_per_row].long()


def decode(meta: NMMeta) -> torch.Tensor:
    """NMMeta -> bool mask [out, in]."""
    out_f, in_f = meta.shape
    if meta.spec.layout == "block":
        motifs = block_motifs(meta.spec.n, device=meta.codes.device)
        return _from_blocks(motifs[meta.codes.long()])
    mask = torch.zeros(out_f * in_f, dtype=torch.bool, device=meta.codes.device)
    mask[kept_index(meta)] = True
    return mask.view(out_f, in_f)


@functools.lru_cache(maxsize=None)
def _row_slot_table(n: int, device: torch.device) -> torch.Tensor:
    """int64 [P * 256, 4], P = 3 if n == 3 else 1: the column offset of each of the 4 slots of a code byte from
    the first column of its span (the 16 * P / n columns the byte's P-byte period covers), keyed by
    phase * 256 + byte. A period of P bytes holds 4 * P slots = 4 * P / n whole groups; at 3:4 a group crosses a
    byte boundary, so the offset depends on the byte's phase b % 3."""
    period = 3 if n == 3 else 1
    cpu = torch.device("cpu")   # built on the CPU whatever the default device is, then moved
    byte = torch.arange(256, device=cpu).unsqueeze(1)
    pos = (byte >> (2 * torch.arange(M, device=cpu))) & 3                            # [256, 4] slot positions
    slot = M * torch.arange(period, device=cpu).view(-1, 1, 1) + torch.arange(M, device=cpu)   # [P, 1, 4]
    return ((slot // n) * M + pos).view(-1, M).to(device)


@functools.lru_cache(maxsize=None)
def _motif_columns(n: int, device: torch.device) -> torch.Tensor:
    """int64 [P, 4, n]: the kept columns of each row of each motif, ascending (row-major nonzero)."""
    motifs = block_motifs(n, device="cpu")
    return motifs.nonzero()[:, 2].view(motifs.shape[0], M, n).to(device)


def _row_kept_index(meta: NMMeta) -> torch.Tensor:
    out_f, in_f = meta.shape
    n, k = meta.spec.n, meta.kept_per_row
    codes = meta.codes
    num_bytes = codes.shape[1]
    period = 3 if n == 3 else 1
    key = codes.int()                                                          # index_select wants int32/int64
    if period > 1:
        key += (torch.arange(num_bytes, device=codes.device, dtype=torch.int32) % period) * 256
    index = _row_slot_table(n, codes.device).index_select(0, key.view(-1)).view(out_f, num_bytes, M)
    span_cols = M * M * period // n
    span = torch.arange(num_bytes, device=codes.device) // period * span_cols  # [bytes] first column of the span
    index += (torch.arange(out_f, device=codes.device) * in_f).view(-1, 1, 1) + span.view(1, -1, 1)
    # Drops the padding slots of the last byte (a copy only when there are some).
    return index.view(out_f, -1)[:, :k].contiguous().view(-1)


def _block_kept_index(meta: NMMeta) -> torch.Tensor:
    out_f, in_f = meta.shape
    n = meta.spec.n
    codes = meta.codes
    blocks_out, blocks_in = codes.shape
    device = codes.device
    # Flat offset of each kept value from its block's top-left corner, per motif: row * in + column.
    offsets = _motif_columns(n, device) + (torch.arange(M, device=device) * in_f).view(1, M, 1)
    per_block = offsets.view(-1, M * n).index_select(0, codes.view(-1).int()).view(blocks_out, blocks_in, M, n)
    corner = (torch.arange(blocks_out, device=device) * (M * in_f)).view(-1, 1, 1, 1) \
        + (torch.arange(blocks_in, device=device) * M).view(1, 1, -1, 1)      # [BO, 1, BI, 1]
    # Values order is row-major (block-row, row in block, block, kept column): the add writes that layout into a
    # contiguous `out` (left to itself it would follow the transposed input's strides).
    index = torch.empty(blocks_out, M, blocks_in, n, dtype=torch.int64, device=device)
    return torch.add(corner, per_block.transpose(1, 2), out=index).view(-1)


@functools.lru_cache(maxsize=None)
def _byte_positions(device: torch.device) -> torch.Tensor:
    """int64 [256, 4]: the four 2-bit fields of each code byte, low bits first: the position inside its group of
    each of the byte's four kept values, whatever N and whichever group a slot falls in."""
    cpu = torch.device("cpu")   # built on the CPU whatever the default device is, then moved
    byte = torch.arange(256, device=cpu).unsqueeze(1)
    return ((byte >> (2 * torch.arange(M, device=cpu))) & 3).to(device)


@functools.lru_cache(maxsize=None)
def _motif_row_columns(n: int, device: torch.device) -> torch.Tensor:
    """int64 [P, 4 * n]: `_motif_columns` flattened, one lookup row per motif id."""
    return _motif_columns(n, torch.device("cpu")).view(-1, M * n).to(device)


@functools.lru_cache(maxsize=None)
def _byte_one_hot(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 16] of `dtype`: `_byte_positions` with each position as a one-hot row of 4 (`decompress_groups`)."""
    return F.one_hot(_byte_positions(torch.device("cpu")), M).view(256, -1).to(device, dtype)


@functools.lru_cache(maxsize=None)
def _motif_row_one_hot(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[P, 4 * n * 4] of `dtype`: `_motif_row_columns` with each column as a one-hot row of 4."""
    cols = _motif_row_columns(n, torch.device("cpu"))
    return F.one_hot(cols, M).view(cols.shape[0], -1).to(device, dtype)


def lookup_key(codes: torch.Tensor) -> torch.Tensor:
    """The codes widened to int32, the key of the lookups below (an embedding takes int32 or int64 indices, not
    uint8): one cast, 4 B per code byte. A caller that looks up the same codes twice casts once and passes it."""
    return codes.int()


def _lookup(meta: NMMeta, row_table: torch.Tensor, block_table: torch.Tensor, tail: tuple[int, ...],
            key: torch.Tensor | None) -> torch.Tensor:
    """Per kept value, the `tail`-shaped entry of a lookup table keyed by code byte (row-wise, 4 entries per row of
    `row_table`) or by motif id (block-wise, 4 * n per row), laid out as `kept_positions` documents; `key` is
    `lookup_key(meta.codes)` (None: cast here)."""
    out_f, in_f = meta.shape
    n = meta.spec.n
    # An embedding lookup (index_select of table rows): advanced indexing `table[key]` measured 3-5x slower on CPU.
    key = lookup_key(meta.codes) if key is None else key
    if meta.spec.layout == "block":
        blocks_out, blocks_in = key.shape
        cols = F.embedding(key, block_table)                                      # [BO, BI, 4 * n * tail]
        return cols.view(blocks_out, blocks_in, M, n, *tail).transpose(1, 2)
    pos = F.embedding(key, row_table)                                             # [out, bytes, 4 * tail]
    k = meta.kept_per_row
    if pos.shape[1] * M != k:   # padding slots in the last byte of each row
        pos = pos.view(out_f, -1, *tail)[:, :k]
    return pos.view(out_f, in_f // M, n, *tail)


def kept_positions(meta: NMMeta, key: torch.Tensor | None = None) -> torch.Tensor:
    """int64 position (0-3) of every kept value inside its group of 4 input columns, derived from the codes by one
    table lookup per code byte (row-wise) or per block (block-wise), with no index arithmetic. Shaped so that
    `values.view(pos.shape)` and the dense matrix viewed as `(*pos.shape[:-1], 4)` line up, for `scatter_groups`
    and `gather_groups`:

        row-wise    [out, in / 4, N]        a group is 4 consecutive columns of one row, N of them kept
        block-wise  [out / 4, 4, in / 4, N] (block-row, row in block, block, kept), a strided view

    Both layouts keep values row-major with N per 4-column group (a transposable block keeps N per row too), so the
    groups are the same and only the lookup differs. A transient, like `kept_index` (8 B per kept value).
    `key`: `lookup_key(meta.codes)` when the caller has it (None: one cast more)."""
    device = meta.codes.device
    return _lookup(meta, _byte_positions(device), _motif_row_columns(meta.spec.n, device), (), key)


def decompress_groups(values: torch.Tensor, meta: NMMeta, key: torch.Tensor | None = None) -> torch.Tensor:
    """Dense [out, in] of `values`' dtype, the matrix `scatter_groups(values, kept_positions(meta), meta.shape)`
    builds. At N = 1 a group holds one value, so the group is that value times the one-hot row of its position:
    one multiply (the lookup gives one-hot rows instead of positions, as many bytes at bf16), where the scatter
    is two kernels (zeros, then scatter). Equal for finite values (a zero slot is +-0; an inf value would write
    nan beside it, where a scatter leaves zeros). `key` as for `kept_positions`."""
    if meta.spec.n != 1:
        return scatter_groups(values, kept_positions(meta, key), meta.shape)
    device, n = meta.codes.device, meta.spec.n
    one_hot = _lookup(meta, _byte_one_hot(values.dtype, device), _motif_row_one_hot(n, values.dtype, device), (M,),
                      key)
    # values first: the product then takes values' row-major layout, also against the block-wise strided view
    return (values.view(*one_hot.shape[:-1], 1) * one_hot).view(meta.shape)


# ---- bags: the decompression and its gradient gather as one embedding-bag kernel each (issue 25) ----------------
# A bag is the run of slots whose kept values fill a span of whole groups: row-wise the 4 slots of a code byte (the 4
# P of a 3-byte period at 3:4, whose groups cross byte boundaries), block-wise the n slots of one row of a 4x4 block.
# Each slot's key picks a table row that is the one-hot of its column inside the span, so
#     W[span]          = sum over the bag's slots of value x table[key]       (embedding_bag, per_sample_weights)
#     grad_value[slot] = <grad_W[span], table[key]>                           (its per-sample-weights gradient)
# are one kernel each: no positions, no zeros to scatter into, no gather index. Every column of a span is the one-hot
# of at most one slot, so both are exact for finite numbers (an inf or nan elsewhere in a span reaches the slot as
# nan, as the N = 1 multiply of `decompress_groups` does).

def _bag_period(n: int) -> int:
    return 3 if n == 3 else 1


def bags_tile(meta: NMMeta) -> bool:
    """True when the slots fill whole bags (always block-wise; row-wise unless the last code byte of each row has
    padding slots, or a 3:4 row ends inside a 3-byte period). The widths of the models always do."""
    if meta.spec.layout == "block":
        return True
    num_bytes = meta.codes.shape[1]
    return num_bytes * M == meta.kept_per_row and num_bytes % _bag_period(meta.spec.n) == 0


@functools.lru_cache(maxsize=None)
def _bag_slots(n: int, layout: str, device: torch.device) -> torch.Tensor:
    """int32: the offset of each slot's key from code x slots-per-bag, shaped to broadcast against the codes."""
    cpu = torch.device("cpu")
    if layout == "block":
        return torch.arange(M * n, dtype=torch.int32, device=cpu).view(1, M, 1, n).to(device)   # row * n + t
    period = _bag_period(n)
    return torch.arange(M * period, dtype=torch.int32, device=cpu).view(period, M).to(device)  # phase * 4 + slot


@functools.lru_cache(maxsize=None)
def _bag_table(n: int, layout: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[keys, span] of `dtype`: row `key` is the one-hot of that slot's column in its span (module section above)."""
    if layout == "block":
        cols = _motif_columns(n, torch.device("cpu")).reshape(-1)                       # [P * 4 * n], 0..3
        return F.one_hot(cols, M).to(device, dtype)
    period = _bag_period(n)
    # _row_slot_table: [phase * 256 + byte, slot] -> column in the span; keys run byte-major (byte * 4P + q).
    cols = _row_slot_table(n, torch.device("cpu")).view(period, 256, M).transpose(0, 1).reshape(-1)
    return F.one_hot(cols, M * M * period // n).to(device, dtype)


@functools.lru_cache(maxsize=None)
def _bag_layout(bags: int, slots: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (offsets [bags]: first slot of each bag, bag [bags * slots]: the bag of each slot), per shape."""
    cpu = torch.device("cpu")
    offsets = torch.arange(0, bags * slots, slots, dtype=torch.int32, device=cpu)
    of_slot = torch.arange(bags, dtype=torch.int32, device=cpu).repeat_interleave(slots)
    return offsets.to(device), of_slot.to(device)


def _slots_per_bag(spec: NMSpec) -> int:
    return spec.n if spec.layout == "block" else M * _bag_period(spec.n)


def bag_key(meta: NMMeta) -> torch.Tensor:
    """int32 [out * k]: every slot's table row, code x slots-per-bag + its slot offset, in values order (bag after
    bag). One add: uint8 codes plus an int32 offset promote to int32, so no separate cast (needs `bags_tile`)."""
    codes, n = meta.codes, meta.spec.n
    slots = _bag_slots(n, meta.spec.layout, codes.device)
    if meta.spec.layout == "block":
        blocks_out, blocks_in = codes.shape
        return torch.add(slots, codes.view(blocks_out, 1, blocks_in, 1), alpha=M * n).view(-1)
    period = _bag_period(n)
    return torch.add(slots, codes.view(codes.shape[0], -1, period, 1), alpha=M * period).view(-1)


def decompress_bags(values: torch.Tensor, meta: NMMeta, key: torch.Tensor) -> torch.Tensor:
    """`decompress(values, meta)` as one embedding-bag kernel from `bag_key(meta)` (section above)."""
    slots = _slots_per_bag(meta.spec)
    offsets, _ = _bag_layout(key.numel() // slots, slots, key.device)
    table = _bag_table(meta.spec.n, meta.spec.layout, values.dtype, key.device)
    # padding_idx None: no padding row (-1 here would make the last table row one). Detached: the forward-only
    # kernel (callers that differentiate take `gather_bags`, as NMLinearFunction's backward does).
    psw = values.detach().reshape(-1)
    dense = torch.embedding_bag(table, key, offsets, False, 0, False, psw, False, None)[0]
    return dense.view(meta.shape)


def gather_bags(dense: torch.Tensor, meta: NMMeta, key: torch.Tensor) -> torch.Tensor:
    """Values [out, k] of a contiguous dense [out, in] at the kept positions (`gather_groups`' result) as one kernel
    from `bag_key(meta)`: the per-sample-weights gradient of `decompress_bags` (section above)."""
    slots = _slots_per_bag(meta.spec)
    bags = key.numel() // slots
    offsets, of_slot = _bag_layout(bags, slots, key.device)
    table = _bag_table(meta.spec.n, meta.spec.layout, dense.dtype, key.device)
    out = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        dense.reshape(bags, -1), table, key, offsets, of_slot, 0, -1)
    return out.view(meta.shape[0], -1)


def scatter_groups(values: torch.Tensor, positions: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Dense [out, in] with `values` [out, k] at their `kept_positions` and zeros elsewhere: one scatter into the
    matrix viewed as groups of 4 columns. The same matrix as `scatter_kept(values, kept_index(meta), shape)`."""
    dense = values.new_zeros(*positions.shape[:-1], M)
    return dense.scatter_(-1, positions, values.reshape(positions.shape)).view(shape)


def gather_groups(dense: torch.Tensor, positions: torch.Tensor, kept_per_row: int) -> torch.Tensor:
    """Values [out, k] of a contiguous dense [out, in] at `kept_positions`; the inverse of `scatter_groups`."""
    return dense.reshape(*positions.shape[:-1], M).gather(-1, positions).view(-1, kept_per_row)


def kept_index(meta: NMMeta) -> torch.Tensor:
    """int64 [out * k]: flat position in the dense [out, in] matrix of every kept value, in values order, derived
    from the codes. A transient: build it where it is used, do not keep it (8 B per kept value)."""
    if meta.spec.layout == "block":
        return _block_kept_index(meta)
    return _row_kept_index(meta)


def is_legal(meta: NMMeta) -> bool:
    """True when the codes describe a legal pattern of `meta.spec` for `meta.shape`."""
    spec = meta.spec
    try:
        spec.check_shape(*meta.shape, name="meta")
    except ValueError:
        return False
    if tuple(meta.codes.shape) != codes_shape(spec, *meta.shape) or meta.codes.dtype != torch.uint8:
        return False
    if spec.layout == "block":
        return bool((meta.codes.long() < block_motifs(spec.n).shape[0]).all())
    pos = _row_positions(meta).view(meta.shape[0], -1, spec.n)
    if not bool((pos[..., 1:] > pos[..., :-1]).all()):   # strictly increasing: distinct, in position order
        return False
    # The padding slots of the last byte must be zero so that a code has one meaning.
    k = meta.kept_per_row
    full = ((meta.codes.unsqueeze(-1) >> _SHIFTS.to(meta.codes.device)) & 3).view(meta.shape[0], -1)
    return bool((full[:, k:] == 0).all())


def compress(dense: torch.Tensor, mask: torch.Tensor, spec: NMSpec) -> tuple[torch.Tensor, NMMeta]:
    """Dense [out, in] and a legal bool mask -> (values [out, k], meta)."""
    meta = encode(mask, spec)
    return gather_groups(dense, kept_positions(meta), meta.kept_per_row), meta


def gather_kept(dense: torch.Tensor, index: torch.Tensor, kept_per_row: int) -> torch.Tensor:
    """Values [out, k] of dense [out, in] at a flat `kept_index`."""
    return dense.reshape(-1).index_select(0, index).view(-1, kept_per_row)


def scatter_kept(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Dense [out, in] with `values` at a flat int64 `kept_index` and zeros elsewhere."""
    dense = values.new_zeros(shape[0] * shape[1])
    return dense.index_copy_(0, index, values.reshape(-1)).view(shape)


def decompress(values: torch.Tensor, meta: NMMeta) -> torch.Tensor:
    """(values [out, k], meta) -> dense [out, in] with zeros at pruned positions."""
    return scatter_groups(values, kept_positions(meta), meta.shape)


def mask_from_scores(scores: torch.Tensor, n: int, layout: str) -> torch.Tensor:
    """Best legal bool mask for `scores` [out, in]: top-n per row group, or the motif with the largest
    summed score per 4x4 block (Apex ASP's `m4n2_2d_best` selection, one matmul against the library)."""
    spec = NMSpec(n, M, layout)
    _check_mask_shape(scores, spec)
    out_f, in_f = scores.shape
    if layout == "row":
        top = scores.reshape(out_f, in_f // M, M).topk(n, dim=-1).indices
        mask = torch.zeros(out_f, in_f // M, M, dtype=torch.bool, device=scores.device)
        return mask.scatter_(-1, top, True).view(out_f, in_f)
    motifs = block_motifs(n, device=scores.device)
    blocks = _to_blocks(scores).reshape(out_f // M, in_f // M, M * M)
    work = torch.promote_types(scores.dtype, torch.float32)   # float64 scores keep their precision
    gain = blocks.to(work) @ motifs.view(-1, M * M).to(work).T   # [out/4, in/4, P]
    return _from_blocks(motifs[gain.argmax(-1)])


def random_mask(out_features: int, in_features: int, spec: NMSpec,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """A uniformly random legal pattern per row group (or per 4x4 block), drawn from `generator`."""
    spec.check_shape(out_features, in_features)
    if spec.layout == "row":
        library = row_patterns(spec.n)
        choice = torch.randint(len(library), (out_features, in_features // M), generator=generator)
        return library[choice].view(out_features, in_features)
    library = block_motifs(spec.n)
    choice = torch.randint(len(library), (out_features // M, in_features // M), generator=generator)
    return _from_blocks(library[choice])
