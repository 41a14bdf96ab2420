"""N:M pattern libraries and compressed storage (distsparse/nm): round trips, legality, the packed code format,
mask selection and slot maps, each checked against a brute-force reference written here from DESIGN s3."""

import functools
import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from distsparse.nm import (
    NMMeta, NMSpec, bag_key, bags_tile, block_motifs, codes_shape, compress, decode, decompress, decompress_bags,
    encode, gather_bags, gather_groups, gather_kept, decompress_groups, is_legal, kept_index, kept_positions,
    mask_from_scores, motif_ids, move_slots, random_mask, row_patterns, scatter_groups, scatter_kept, slot_map,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = [NMSpec(n, 4, layout) for n in (1, 2, 3) for layout in ("row", "block")]
FAST = settings(max_examples=30, deadline=None)


@st.composite
def spec_shape_seed(draw, specs=SPECS):
    spec = draw(st.sampled_from(specs))
    out_f = draw(st.integers(1, 5)) * 4 if spec.layout == "block" else draw(st.integers(1, 9))
    in_f = draw(st.integers(1, 7)) * 4
    return spec, out_f, in_f, draw(st.integers(0, 2**31 - 1))


def legal_mask(spec, out_f, in_f, seed):
    return random_mask(out_f, in_f, spec, torch.Generator().manual_seed(seed))


# ---- brute-force references ----------------------------------------------------------------------------------

@functools.cache
def all_blocks_with_n_per_row_and_column(n):
    """Every 4x4 bool matrix with n ones in each row and column, by enumerating all 2^16 matrices."""
    bits = (torch.arange(1 << 16).unsqueeze(1) >> torch.arange(16)) & 1
    blocks = bits.view(-1, 4, 4)
    ok = (blocks.sum(-1) == n).all(-1) & (blocks.sum(-2) == n).all(-1)
    return blocks[ok].bool()


def reference_row_codes(mask):
    """DESIGN s3: the 2-bit in-group position of each kept value, four per byte, first value in the low bits,
    padding slots zero."""
    rows = []
    for row in mask.tolist():
        pos = [c % 4 for c, kept in enumerate(row) if kept]
        pos += [0] * (-len(pos) % 4)
        rows.append([sum(p << (2 * i) for i, p in enumerate(pos[b:b + 4])) for b in range(0, len(pos), 4)])
    return torch.tensor(rows, dtype=torch.uint8)


def unpack_row_codes(codes):
    """Inverse of `reference_row_codes`: int positions [out, 4 * bytes] (padding slots included)."""
    return torch.stack([(codes.long() >> (2 * i)) & 3 for i in range(4)], dim=-1).flatten(1)


def pack_positions(pos):
    """[out, 4 * bytes] int positions -> packed uint8 codes (no checks, so corrupt codes can be built)."""
    pos = pos.view(pos.shape[0], -1, 4)
    return sum(pos[..., i] << (2 * i) for i in range(4)).to(torch.uint8)


def kept_values_in_order(dense, mask):
    """Values [out, k]: each row's kept weights in ascending column order (boolean indexing is row-major)."""
    return dense[mask].view(mask.shape[0], -1)


# ---- libraries -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, num_rows, num_blocks", [(1, 4, 24), (2, 6, 90), (3, 4, 24)])
def test_libraries_hold_every_legal_pattern_once(n, num_rows, num_blocks):
    rows = row_patterns(n)
    assert rows.shape == (num_rows, 4) == (math.comb(4, n), 4)
    assert {tuple(r) for r in rows.tolist()} == {tuple(i in c for i in range(4))
                                                 for c in itertools.combinations(range(4), n)}
    motifs = block_motifs(n)
    assert motifs.shape == (num_blocks, 4, 4)
    assert bool((motifs.sum(-1) == n).all()) and bool((motifs.sum(-2) == n).all())
    as_set = {tuple(m.flatten().tolist()) for m in motifs}
    assert len(as_set) == num_blocks
    assert as_set == {tuple(m.flatten().tolist()) for m in all_blocks_with_n_per_row_and_column(n)}


def test_three_of_four_motifs_are_the_complements_of_one_of_four():
    ones = {tuple((~m).flatten().tolist()) for m in block_motifs(1)}
    assert ones == {tuple(m.flatten().tolist()) for m in block_motifs(3)}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_motif_ids_index_the_library_and_mark_illegal_blocks(n):
    motifs = block_motifs(n)
    assert torch.equal(motif_ids(motifs, n), torch.arange(len(motifs)))
    illegal = torch.zeros(3, 4, 4, dtype=torch.bool)
    illegal[1, 0, :n + 1] = True                      # one row keeps n + 1
    illegal[2] = motifs[0]
    illegal[2, :, 0] = ~illegal[2, :, 0]              # column 0 flipped: counts off
    assert motif_ids(illegal, n).tolist() == [-1, -1, -1]


# ---- round trips and format ------------------------------------------------------------------------------------

@FAST
@given(spec_shape_seed())
def test_encode_decode_round_trips_and_is_legal(case):
    spec, out_f, in_f, seed = case
    mask = legal_mask(spec, out_f, in_f, seed)
    meta = encode(mask, spec)
    assert tuple(meta.codes.shape) == codes_shape(spec, out_f, in_f) and meta.codes.dtype == torch.uint8
    assert is_legal(meta)
    assert torch.equal(decode(meta), mask)


@FAST
@given(spec_shape_seed())
def test_compress_keeps_each_rows_values_in_column_order_and_decompress_restores_the_masked_matrix(case):
    spec, out_f, in_f, seed = case
    gen = torch.Generator().manual_seed(seed)
    mask = legal_mask(spec, out_f, in_f, seed)
    dense = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64)
    values, meta = compress(dense, mask, spec)
    assert values.shape == (out_f, in_f * spec.n // 4)
    assert torch.equal(values, kept_values_in_order(dense, mask))
    assert torch.equal(decompress(values, meta), torch.where(mask, dense, torch.zeros_like(dense)))
    assert torch.equal(kept_index(meta), mask.flatten().nonzero().flatten())


def random_codes(spec, out_f, in_f, gen):
    """Legal codes drawn directly, not through `encode`: a library index per block, or n distinct ascending
    positions per row group, packed."""
    if spec.layout == "block":
        num = len(block_motifs(spec.n))
        return torch.randint(num, (out_f // 4, in_f // 4), generator=gen).to(torch.uint8)
    pos = torch.rand(out_f, in_f // 4, 4, generator=gen).argsort(-1)[..., :spec.n].sort(-1).values.flatten(1)
    return pack_positions(torch.cat([pos, pos.new_zeros(out_f, -pos.shape[1] % 4)], dim=1))


def brute_force_decompress(values, codes, spec, out_f, in_f):
    """Dense [out, in] read off the codes one kept value at a time: its 2-bit field (row-wise), or its block's motif
    in the library, visited in row-major order (block-wise)."""
    dense = torch.zeros(out_f, in_f, dtype=values.dtype)
    if spec.layout == "row":
        for o in range(out_f):
            for slot in range(in_f * spec.n // 4):
                pos = (int(codes[o, slot // 4]) >> (2 * (slot % 4))) & 3
                dense[o, (slot // spec.n) * 4 + pos] = values[o, slot]
        return dense
    library = block_motifs(spec.n).tolist()
    for o in range(out_f):
        kept = [c for c in range(in_f) if library[int(codes[o // 4, c // 4])][o % 4][c % 4]]
        for slot, c in enumerate(kept):
            dense[o, c] = values[o, slot]
    return dense


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SPECS), st.integers(1, 5), st.integers(1, 13), st.integers(0, 2**31 - 1))
@example(NMSpec(1), 3, 1, 0)   # one kept value per row, three padding slots: the index must still be contiguous
def test_decompress_from_the_codes_equals_a_brute_force_decode_and_gather_inverts_it(spec, rows, groups, seed):
    # Up to 13 groups: every phase of the 3:4 code period (3 bytes = 4 groups) and every padding of the last byte.
    out_f, in_f = (4 * rows if spec.layout == "block" else rows), 4 * groups
    gen = torch.Generator().manual_seed(seed)
    meta = NMMeta(random_codes(spec, out_f, in_f, gen), spec, (out_f, in_f))
    assert is_legal(meta)
    values = torch.randn(out_f, in_f * spec.n // 4, generator=gen, dtype=torch.float64)
    dense = decompress(values, meta)
    assert torch.equal(dense, brute_force_decompress(values, meta.codes, spec, out_f, in_f))
    index = kept_index(meta)
    assert index.dtype == torch.int64 and index.is_contiguous()
    assert bool((index[1:] > index[:-1]).all())   # values order is row-major
    assert torch.equal(gather_kept(dense, index, values.shape[1]), values)


def brute_force_positions(codes, spec, out_f, in_f):
    """[out, in/4, n]: the column inside its group of 4 of each kept value of each group, from the same one-value-
    at-a-time reading of the codes as `brute_force_decompress`."""
    marked = brute_force_decompress(torch.ones(out_f, in_f * spec.n // 4), codes, spec, out_f, in_f)
    groups = marked.view(out_f, in_f // 4, 4).bool()
    return torch.tensor([[[c for c in range(4) if groups[o, g, c]] for g in range(in_f // 4)] for o in range(out_f)],
                        dtype=torch.int64).view(out_f, in_f // 4, spec.n)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SPECS), st.integers(1, 5), st.integers(1, 13), st.integers(0, 2**31 - 1))
@example(NMSpec(1), 3, 1, 0)
@example(NMSpec(3), 2, 13, 0)   # 3:4 groups crossing byte boundaries, with a padded last byte
def test_kept_positions_are_each_groups_kept_columns_and_give_the_flat_index_results_bit_for_bit(
        spec, rows, groups, seed):
    out_f, in_f = (4 * rows if spec.layout == "block" else rows), 4 * groups
    gen = torch.Generator().manual_seed(seed)
    meta = NMMeta(random_codes(spec, out_f, in_f, gen), spec, (out_f, in_f))
    pos = kept_positions(meta)
    assert pos.dtype == torch.int64 and pos.numel() == out_f * in_f * spec.n // 4
    # Values order is the same in both layouts: rows, then groups of 4 columns, then kept columns ascending.
    grouped = pos.reshape(out_f, in_f // 4, spec.n) if spec.layout == "row" else \
        pos.reshape(out_f // 4, 4, in_f // 4, spec.n).reshape(out_f, in_f // 4, spec.n)
    assert torch.equal(grouped, brute_force_positions(meta.codes, spec, out_f, in_f))
    # The group path and the flat index path (the optimizer's scatter and gather) agree bit for bit.
    values = torch.randn(out_f, in_f * spec.n // 4, generator=gen)
    dense = torch.randn(out_f, in_f, generator=gen)
    index = kept_index(meta)
    assert torch.equal(scatter_groups(values, pos, meta.shape).view(torch.int32),
                       scatter_kept(values, index, meta.shape).view(torch.int32))
    assert torch.equal(gather_groups(dense, pos, values.shape[1]).view(torch.int32),
                       gather_kept(dense, index, values.shape[1]).view(torch.int32))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SPECS), st.integers(1, 5), st.integers(1, 13), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
@example(NMSpec(1), 3, 5, 0, torch.bfloat16)   # 1:4 rows of 5 kept values: 3 padding slots in the last byte
@example(NMSpec(1, 4, "block"), 2, 3, 0, torch.bfloat16)
def test_decompress_groups_equals_a_brute_force_decode_in_the_values_dtype(spec, rows, groups, seed, dtype):
    # The forward's W (N = 1: values x one-hot rows; N > 1: zeros + scatter), every value where the codes put it and
    # zeros elsewhere, in the values' dtype and row-major whatever the layout's strided lookup.
    out_f, in_f = (4 * rows if spec.layout == "block" else rows), 4 * groups
    gen = torch.Generator().manual_seed(seed)
    meta = NMMeta(random_codes(spec, out_f, in_f, gen), spec, (out_f, in_f))
    values = torch.randn(out_f, in_f * spec.n // 4, generator=gen, dtype=torch.float64).to(dtype)
    dense = decompress_groups(values, meta)
    assert dense.dtype == dtype and dense.shape == (out_f, in_f) and dense.is_contiguous()
    assert torch.equal(dense.double(), brute_force_decompress(values.double(), meta.codes, spec, out_f, in_f))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SPECS), st.integers(1, 5), st.integers(1, 13), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
@example(NMSpec(1), 3, 4, 0, torch.bfloat16)    # one code byte per 16 columns: 1 bag per byte
@example(NMSpec(3), 2, 12, 0, torch.float32)    # 3:4: a bag is a 3-byte period, its groups cross byte boundaries
@example(NMSpec(1), 3, 5, 0, torch.float32)     # padding slots: no bags
def test_the_bags_decompress_and_gather_as_the_brute_force_decode_and_the_group_gather_bit_for_bit(
        spec, rows, groups, seed, dtype):
    # decompress_bags (embedding_bag of one-hot rows weighted by the values) and gather_bags (its per-sample-weights
    # gradient) against the brute-force decode and gather_groups at the brute-force positions, exactly.
    out_f, in_f = (4 * rows if spec.layout == "block" else rows), 4 * groups
    gen = torch.Generator().manual_seed(seed)
    meta = NMMeta(random_codes(spec, out_f, in_f, gen), spec, (out_f, in_f))
    kept = in_f * spec.n // 4
    tiles = spec.layout == "block" or (kept % 4 == 0 and (spec.n != 3 or kept % 12 == 0))   # no padding slots
    assert bags_tile(meta) == tiles
    if not tiles:
        return
    key = bag_key(meta)
    assert key.dtype == torch.int32 and key.numel() == out_f * kept
    values = torch.randn(out_f, kept, generator=gen, dtype=torch.float64).to(dtype)
    dense = decompress_bags(values, meta, key)
    assert dense.dtype == dtype and dense.shape == (out_f, in_f) and dense.is_contiguous()
    assert torch.equal(dense.double(), brute_force_decompress(values.double(), meta.codes, spec, out_f, in_f))
    grad = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64).to(dtype)
    pos = brute_force_positions(meta.codes, spec, out_f, in_f)                 # [out, in / 4, n], values order
    expected = grad.view(out_f, in_f // 4, 4).gather(-1, pos).view(out_f, kept)
    got = gather_bags(grad, meta, key)
    assert got.dtype == dtype and torch.equal(got, expected)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_kept_positions_and_the_decompressed_matrix_live_on_the_device_of_the_codes(spec):
    # The lookup tables are cached on the CPU and moved to the codes' device; meta tensors prove the move without a
    # GPU (a table left on the CPU would make the lookup raise or return a CPU tensor).
    cpu = encode(random_mask(8, 16, spec, torch.Generator().manual_seed(0)), spec)
    meta = NMMeta(cpu.codes.to("meta"), spec, cpu.shape)
    pos = kept_positions(meta)
    assert pos.device.type == "meta" and pos.shape == kept_positions(cpu).shape
    assert decompress(torch.empty(8, 16 * spec.n // 4, device="meta"), meta).device.type == "meta"
    dense = decompress_groups(torch.empty(8, 16 * spec.n // 4, device="meta", dtype=torch.bfloat16), meta)
    assert dense.device.type == "meta" and dense.dtype == torch.bfloat16 and dense.shape == (8, 16)
    if bags_tile(meta):
        key = bag_key(meta)
        dense = decompress_bags(torch.empty(8, 16 * spec.n // 4, device="meta", dtype=torch.bfloat16), meta, key)
        assert dense.device.type == "meta" and dense.dtype == torch.bfloat16 and dense.shape == (8, 16)
        assert gather_bags(dense, meta, key).shape == (8, 16 * spec.n // 4)


@FAST
@given(spec_shape_seed([s for s in SPECS if s.layout == "row"]))
def test_row_codes_are_packed_two_bit_positions_low_bits_first(case):
    spec, out_f, in_f, seed = case
    mask = legal_mask(spec, out_f, in_f, seed)
    assert torch.equal(encode(mask, spec).codes, reference_row_codes(mask))


@FAST
@given(spec_shape_seed([s for s in SPECS if s.layout == "block"]))
def test_block_codes_are_library_indices_of_each_block(case):
    spec, out_f, in_f, seed = case
    mask = legal_mask(spec, out_f, in_f, seed)
    library = [m.tolist() for m in block_motifs(spec.n)]
    expected = [[library.index(mask[4 * r:4 * r + 4, 4 * c:4 * c + 4].tolist()) for c in range(in_f // 4)]
                for r in range(out_f // 4)]
    assert encode(mask, spec).codes.tolist() == expected


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_random_mask_is_reproducible_and_uniform_over_the_library(spec):
    # 200 draws per pattern: every count within 5 sigma of uniform (binomial sigma = sqrt(200 (1 - 1/P))).
    num = len(row_patterns(spec.n)) if spec.layout == "row" else len(block_motifs(spec.n))
    out_f, in_f = (4, 200 * num) if spec.layout == "row" else (40, 80 * num)
    a = legal_mask(spec, out_f, in_f, 7)
    assert torch.equal(a, legal_mask(spec, out_f, in_f, 7))
    assert not torch.equal(a, legal_mask(spec, out_f, in_f, 8))
    if spec.layout == "row":
        library = [tuple(p) for p in row_patterns(spec.n).tolist()]
        ids = torch.tensor([library.index(tuple(g)) for g in a.view(-1, 4).tolist()])
    else:
        ids = motif_ids(a.view(10, 4, -1, 4).transpose(1, 2), spec.n).flatten()
    assert int(ids.min()) >= 0
    counts = torch.bincount(ids, minlength=num).double()
    assert counts.sum() == 200 * num
    assert float((counts - 200).abs().max()) <= 5 * math.sqrt(200)


def test_encode_refuses_a_mask_that_breaks_the_pattern():
    mask = legal_mask(NMSpec(2, 4, "block"), 8, 8, 0)
    row_ok_block_not = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.bool)   # every row 2:4, columns 4/4/0/0
    mask[:4, :4] = row_ok_block_not
    encode(mask, NMSpec(2, 4, "row"))
    with pytest.raises(ValueError, match="not a legal 2:4-block"):
        encode(mask, NMSpec(2, 4, "block"))


# ---- legality of corrupted codes -------------------------------------------------------------------------------

def corrupt_row_positions(spec, out_f, in_f, seed, edit):
    meta = encode(legal_mask(spec, out_f, in_f, seed), spec)
    pos = unpack_row_codes(meta.codes)
    edit(pos, meta.kept_per_row)
    return NMMeta(pack_positions(pos), spec, (out_f, in_f))


@pytest.mark.parametrize("n", [2, 3])
def test_is_legal_rejects_duplicate_positions_in_a_group(n):
    def dup(pos, k):
        pos[1, 1] = pos[1, 0]
    assert not is_legal(corrupt_row_positions(NMSpec(n), 3, 16, 0, dup))


@pytest.mark.parametrize("n", [2, 3])
def test_is_legal_rejects_positions_out_of_order(n):
    def swap(pos, k):
        pos[2, n], pos[2, n + 1] = pos[2, n + 1].clone(), pos[2, n].clone()   # second group, first two slots
    assert not is_legal(corrupt_row_positions(NMSpec(n), 3, 16, 0, swap))


@pytest.mark.parametrize("n, in_f", [(1, 8), (1, 20), (3, 12)])   # k = 2, 5, 9: the last byte is padded
def test_is_legal_rejects_nonzero_padding_bits(n, in_f):
    def pad(pos, k):
        pos[0, k] = 1
    meta = corrupt_row_positions(NMSpec(n), 2, in_f, 0, pad)
    assert not is_legal(meta)
    assert is_legal(corrupt_row_positions(NMSpec(n), 2, in_f, 0, lambda pos, k: None))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_is_legal_rejects_motif_ids_past_the_library(n):
    spec = NMSpec(n, 4, "block")
    meta = encode(legal_mask(spec, 8, 8, 0), spec)
    codes = meta.codes.clone()
    codes[1, 0] = len(block_motifs(n)) - 1
    assert is_legal(NMMeta(codes, spec, meta.shape))
    for bad in (len(block_motifs(n)), 255):
        codes[1, 0] = bad
        assert not is_legal(NMMeta(codes, spec, meta.shape))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_is_legal_rejects_codes_of_the_wrong_shape_or_dtype(spec):
    meta = encode(legal_mask(spec, 8, 16, 0), spec)
    assert is_legal(meta)
    assert not is_legal(NMMeta(meta.codes[:-1], spec, meta.shape))
    assert not is_legal(NMMeta(torch.cat([meta.codes, meta.codes[:, :1]], 1), spec, meta.shape))
    assert not is_legal(NMMeta(meta.codes.long(), spec, meta.shape))
    assert not is_legal(NMMeta(meta.codes, spec, (8, 18)))     # in not divisible by 4


# ---- mask selection --------------------------------------------------------------------------------------------

def best_achievable_per_group(scores, n, layout):
    """Brute force: the best summed score of any legal pattern, per row group or per 4x4 block."""
    out_f, in_f = scores.shape
    if layout == "row":
        groups = scores.view(out_f, in_f // 4, 4)
        combos = [list(c) for c in itertools.combinations(range(4), n)]
        return torch.stack([groups[..., c].sum(-1) for c in combos], -1).amax(-1)
    blocks = scores.view(out_f // 4, 4, in_f // 4, 4).transpose(1, 2)
    motifs = all_blocks_with_n_per_row_and_column(n)
    return (blocks.unsqueeze(-3) * motifs.double()).sum((-1, -2)).amax(-1)   # [bo, bi, P] -> best


def chosen_per_group(scores, mask, layout):
    picked = torch.where(mask, scores, torch.zeros_like(scores))
    out_f, in_f = scores.shape
    if layout == "row":
        return picked.view(out_f, in_f // 4, 4).sum(-1)
    return picked.view(out_f // 4, 4, in_f // 4, 4).sum((1, 3))


@FAST
@given(spec_shape_seed(), st.booleans())
def test_mask_from_scores_is_legal_and_reaches_the_best_summed_score(case, integer_scores):
    spec, out_f, in_f, seed = case
    gen = torch.Generator().manual_seed(seed)
    if integer_scores:   # many ties
        scores = torch.randint(0, 3, (out_f, in_f), generator=gen).double()
    else:
        scores = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64)
    mask = mask_from_scores(scores, spec.n, spec.layout)
    assert is_legal(encode(mask, spec))
    torch.testing.assert_close(chosen_per_group(scores, mask, spec.layout),
                               best_achievable_per_group(scores, spec.n, spec.layout), rtol=0, atol=1e-12)


# ---- slot maps -------------------------------------------------------------------------------------------------

def overlapping_masks(spec, out_f, in_f, seed):
    """Two legal masks sharing about half of their groups (or blocks), so that many links survive."""
    old, fresh = legal_mask(spec, out_f, in_f, seed), legal_mask(spec, out_f, in_f, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    if spec.layout == "row":
        keep = torch.rand(out_f, in_f // 4, generator=gen) < 0.5
        keep = keep.repeat_interleave(4, 1)
    else:
        keep = torch.rand(out_f // 4, in_f // 4, generator=gen) < 0.5
        keep = keep.repeat_interleave(4, 0).repeat_interleave(4, 1)
    return old, torch.where(keep, old, fresh)


@FAST
@given(spec_shape_seed())
def test_slot_map_and_move_slots_keep_every_surviving_link_and_fill_new_ones(case):
    spec, out_f, in_f, seed = case
    old_mask, new_mask = overlapping_masks(spec, out_f, in_f, seed)
    dense = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    old_values, old_meta = compress(dense, old_mask, spec)
    new_meta = encode(new_mask, spec)

    old_slot = {}   # (row, col) -> slot in the old values, from the dense mask
    for slot, (r, c) in enumerate(old_mask.nonzero().tolist()):
        old_slot[(r, c)] = slot
    new_links = new_mask.nonzero().tolist()
    expected_slots = [old_slot.get((r, c), -1) for r, c in new_links]
    expected_values = [dense[r, c].item() if old_mask[r, c] else 7.5 for r, c in new_links]

    slots = slot_map(old_meta, new_meta)
    assert slots.tolist() == expected_slots
    moved = move_slots(old_values, slots, fill=7.5)
    assert moved.shape == old_values.shape
    assert moved.flatten().tolist() == expected_values
