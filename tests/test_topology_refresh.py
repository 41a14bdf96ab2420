"""Topology refresh: schedules, selection, regrowth with MPR, legality, value moves and determinism.

References are written here from the paper and research formulas: float64 schedule math (research s2a/s2b),
exact Plackett-Luce probabilities for sampling without replacement (research s2a/s3), a python argmax over
the pattern library for the standard projection (paper App. E.2), dense masks for the value moves.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distsparse.nm import (
    NMMeta, NMSpec, block_motifs, decode, encode, group_counts_ok, is_legal, random_mask, row_patterns,
)
from distsparse.topology import (
    RefreshParams, ch_scores, check_legal, choose_patterns, default_mpr_rho, is_refresh_step, refresh_generator,
    refresh_matrix, select_units, selection_count, t_end_for, temperature_at, zeta_at,
)

T_END = 100


def make_matrix(out_f: int, in_f: int, spec: NMSpec, seed: int) -> tuple[torch.Tensor, NMMeta]:
    gen = torch.Generator().manual_seed(seed)
    meta = encode(random_mask(out_f, in_f, spec, gen), spec)
    return torch.randn(out_f, meta.kept_per_row, generator=gen), meta


def dense(values: torch.Tensor, meta: NMMeta) -> torch.Tensor:
    out = torch.zeros(meta.shape)
    out[decode(meta)] = values.reshape(-1)   # boolean indexing is row-major: the values layout
    return out


def units_of(mask: torch.Tensor, layout: str) -> torch.Tensor:
    """[U, unit size] patterns: row groups, or 4x4 blocks flattened row-major."""
    out_f, in_f = mask.shape
    if layout == "row":
        return mask.reshape(-1, 4)
    return mask.reshape(out_f // 4, 4, in_f // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def refresh(weights, meta, *, step=10, seed=0, name="w", **params):
    return refresh_matrix(weights, meta, step=step, t_end=T_END, params=RefreshParams(**params),
                          generator=refresh_generator(seed, step, name))


# --- schedules -----------------------------------------------------------------------------------------------

def test_zeta_follows_the_cosine_decay_and_is_zero_from_t_end_on():
    for step in (0, 1, 30, 50, 99, 100, 150):
        want = 0.1 / 2 * (1 + math.cos(math.pi * min(step, 100) / 100))
        assert zeta_at(step, 100, 0.1) == pytest.approx(want, abs=1e-15)
    assert zeta_at(0, 100, 0.3) == pytest.approx(0.3) and zeta_at(100, 100, 0.3) == pytest.approx(0.0, abs=1e-15)


def test_temperature_anneals_linearly_from_one_to_nine_over_t_end():
    for step, want in ((0, 1.0), (25, 3.0), (50, 5.0), (100, 9.0), (400, 9.0)):
        assert temperature_at(step, 100, 1.0, 9.0) == pytest.approx(want)


def test_t_end_is_three_quarters_of_training():
    assert t_end_for(1000) == 750 and t_end_for(10) == 7


def test_refresh_steps_are_every_interval_until_t_end_then_frozen():
    assert [s for s in range(1000) if is_refresh_step(s, 100, 750)] == [100, 200, 300, 400, 500, 600, 700]
    assert is_refresh_step(800, 100, 800) and not is_refresh_step(900, 100, 800)
    with pytest.raises(ValueError, match="update_interval: got 0"):
        is_refresh_step(5, 0, 100)


# --- selection -----------------------------------------------------------------------------------------------

def test_selection_count_rounds_halves_up():
    assert [selection_count(0.1, n) for n in (24, 25, 26, 5, 0)] == [2, 3, 3, 1, 0]


def plackett_luce_selected(weights: list[float], num_selected: int) -> list[float]:
    """P(unit i is selected) when len - num_selected units are kept one at a time with p ~ weight."""
    num = len(weights)
    prob = [0.0] * num
    for order in itertools.permutations(range(num), num - num_selected):
        p, left = 1.0, sum(weights)
        for i in order:
            p *= weights[i] / left
            left -= weights[i]
        for i in set(range(num)) - set(order):
            prob[i] += p
    return prob


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_soft_selection_matches_sampling_without_replacement_with_magnitude_power_t(temperature):
    mag = torch.tensor([0.5, 1.0, 1.5, 2.0])
    want = plackett_luce_selected([m ** temperature for m in mag.tolist()], 2)
    gen = torch.Generator().manual_seed(1)
    trials = 2000
    counts = torch.zeros(4)
    for _ in range(trials):
        counts[select_units(mag, 2, temperature=temperature, generator=gen)] += 1
    torch.testing.assert_close(counts / trials, torch.tensor(want, dtype=torch.float32), atol=0.035, rtol=0)


def test_soft_selection_keeps_high_magnitude_units_far_more_often():
    mag = torch.cat([torch.full((5000,), 0.5), torch.full((5000,), 1.0)])
    selected = select_units(mag, 1000, temperature=3.0, generator=torch.Generator().manual_seed(2))
    low_share = float((selected < 5000).float().mean())
    assert low_share > 0.85        # keep odds 1 : 8 per unit; a uniform draw would give 0.5


def test_hard_selection_takes_the_lowest_magnitudes_with_ties_to_lower_ids():
    mag = torch.tensor([1.0, 0.5, 0.5, 0.5, 2.0, 0.1])
    assert select_units(mag, 3, mode="hard").tolist() == [1, 2, 5]
    assert select_units(mag, 0, mode="hard").tolist() == []


# --- regrowth ------------------------------------------------------------------------------------------------

def test_argmax_regrowth_breaks_ties_to_the_lowest_pattern_and_mpr_forces_the_next():
    lib = row_patterns(1)
    scores = torch.zeros(2, 4)
    none = torch.zeros(2, 4, dtype=torch.bool)
    old = torch.tensor([0, 2])
    ids, excl = choose_patterns(scores, none, old, lib, rho=0.0, generator=torch.Generator().manual_seed(0))
    assert ids.tolist() == [0, 0] and excl.tolist() == [False, False]
    ids, excl = choose_patterns(scores, none, old, lib, rho=1.0, generator=torch.Generator().manual_seed(0))
    assert ids.tolist() == [1, 0] and excl.tolist() == [True, True]


def test_sampled_regrowth_picks_patterns_in_proportion_to_their_score():
    lib = row_patterns(1)
    scores = torch.tensor([[1.0, 3.0, 0.0, 0.0]]).repeat(4000, 1)
    ids, _ = choose_patterns(scores, torch.zeros(4000, 4, dtype=torch.bool), torch.zeros(4000, dtype=torch.long),
                             lib, mode="sample", generator=torch.Generator().manual_seed(4))
    freq = torch.bincount(ids, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.25, 0.75, 0.0, 0.0]), atol=0.03, rtol=0)


def test_default_mpr_rho_is_the_papers_setting():
    assert default_mpr_rho(NMSpec(1, 4, "row")) == 0.5
    assert default_mpr_rho(NMSpec(2, 4, "row")) == 0.75
    assert default_mpr_rho(NMSpec(3, 4, "row")) == 0.0
    assert default_mpr_rho(NMSpec(1, 4, "block")) == 0.0


# --- refresh: legality and value moves (property-based) -------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 4), cols=st.integers(1, 5), n=st.integers(1, 3), layout=st.sampled_from(["row", "block"]),
    rowwise=st.sampled_from(["group_full", "link_survivors"]), selection=st.sampled_from(["soft", "hard"]),
    regrow=st.sampled_from(["argmax", "sample"]), rho=st.sampled_from([None, 0.0, 0.3, 1.0]),
    zeta0=st.sampled_from([0.1, 0.5, 1.0]), step=st.integers(0, T_END), seed=st.integers(0, 2**31),
)
def test_every_refresh_is_legal_keeps_the_active_count_and_moves_surviving_weights(
        rows, cols, n, layout, rowwise, selection, regrow, rho, zeta0, step, seed):
    if layout == "block":
        rowwise = "group_full"
    spec = NMSpec(n, 4, layout)
    weights, meta = make_matrix(4 * rows, 4 * cols, spec, seed)
    res = refresh(weights, meta, step=step, seed=seed, zeta0=zeta0, selection=selection,
                  rowwise_selection=rowwise, regrow=regrow, mpr_rho=rho)
    check_legal(res.meta, "w")
    old_mask, new_mask = decode(meta), decode(res.meta)
    assert is_legal(res.meta) and group_counts_ok(new_mask, spec)
    assert int(new_mask.sum()) == int(old_mask.sum())
    before, after = dense(weights, meta), dense(res.new_values, res.meta)
    both = old_mask & new_mask
    assert torch.equal(after[both], before[both])                  # surviving links keep their weight
    assert bool((after[new_mask & ~old_mask] == 0).all())          # new links start at zero
    assert res.stats["links_changed"] == int((new_mask & ~old_mask).sum())
    changed = (units_of(old_mask, layout) != units_of(new_mask, layout)).any(1)
    assert res.stats["groups_changed"] == int(changed.sum())
    assert res.stats["groups_changed"] <= res.stats["groups_selected"]
    if rowwise == "group_full":
        num_units = units_of(old_mask, layout).shape[0]
        assert res.stats["groups_selected"] == math.floor(zeta_at(step, T_END, zeta0) * num_units + 0.5)


# --- refresh: the standard projection and MPR -----------------------------------------------------------------

@pytest.mark.parametrize("n,layout", [(1, "row"), (2, "row"), (3, "row"), (1, "block"), (2, "block")])
def test_rho_zero_is_the_standard_projection_of_the_cleared_mask(n, layout):
    spec = NMSpec(n, 4, layout)
    weights, meta = make_matrix(16, 24, spec, seed=n)
    res = refresh(weights, meta, zeta0=0.5, selection="hard", mpr_rho=0.0)
    old_mask = decode(meta)
    old_units = units_of(old_mask, layout)
    num_units = old_units.shape[0]
    # Hard selection, by hand: the units with the lowest mean |w| over their active links.
    mag = units_of(dense(weights, meta).abs(), layout).sum(1) / old_units.sum(1)
    count = math.floor(zeta_at(10, T_END, 0.5) * num_units + 0.5)
    selected = torch.sort(mag, stable=True).indices[:count]
    cleared = old_mask & ~unit_cover(old_mask.shape, layout, selected)
    scores = units_of(ch_scores(cleared, "ch2").double(), layout)
    lib = (row_patterns(n) if layout == "row" else block_motifs(n).reshape(-1, 16)).double()
    new_units = units_of(decode(res.meta), layout)
    keep = torch.ones(num_units, dtype=torch.bool)
    keep[selected] = False
    assert torch.equal(new_units[keep], old_units[keep])           # unselected units untouched
    for u in selected.tolist():
        gains = [float((scores[u] * p).sum()) for p in lib]
        chosen = float((scores[u] * new_units[u].double()).sum())
        assert chosen == pytest.approx(max(gains), rel=1e-5, abs=1e-6)
        if n == 1 and layout == "row":                             # no sum rounding: exact first-max pattern
            assert torch.equal(new_units[u], lib[gains.index(max(gains))].bool())


def unit_cover(shape, layout, selected):
    """Bool [O, I], True on the positions of the units `selected` (row groups or 4x4 blocks)."""
    out_f, in_f = shape
    hit = torch.zeros(out_f * in_f // (4 if layout == "row" else 16), dtype=torch.bool)
    hit[selected] = True
    if layout == "row":
        return hit.view(out_f, in_f // 4).repeat_interleave(4, 1)
    return hit.view(out_f // 4, in_f // 4).repeat_interleave(4, 0).repeat_interleave(4, 1)


@pytest.mark.parametrize("n,layout,rowwise", [(1, "row", "group_full"), (2, "row", "group_full"),
                                             (2, "row", "link_survivors"), (3, "row", "link_survivors"),
                                             (1, "block", "group_full"), (2, "block", "group_full")])
def test_rho_one_changes_every_selected_unit(n, layout, rowwise):
    weights, meta = make_matrix(16, 32, NMSpec(n, 4, layout), seed=5)
    stats = refresh(weights, meta, zeta0=0.5, mpr_rho=1.0, rowwise_selection=rowwise).stats
    assert stats["groups_selected"] > 0
    assert stats["groups_changed"] == stats["groups_selected"] == stats["mpr_exclusions"]


@pytest.mark.parametrize("n", [1, 2])
def test_changed_fraction_grows_with_rho(n):
    rhos = [0.0, 0.25, 0.5, 0.75, 1.0]
    totals = torch.zeros(len(rhos))
    for seed in range(4):
        weights, meta = make_matrix(16, 64, NMSpec(n, 4, "row"), seed=seed)
        changed = torch.tensor([refresh(weights, meta, seed=seed, zeta0=0.5, mpr_rho=rho).stats["groups_changed"]
                                for rho in rhos])
        assert bool((changed[1:] >= changed[:-1]).all())    # same draws: exclusions grow monotonically in rho
        totals += changed
    assert bool((totals[1:] > totals[:-1]).all()), totals


# --- refresh: modes -------------------------------------------------------------------------------------------

def test_link_survivors_coincides_with_group_full_at_one_of_four():
    weights, meta = make_matrix(12, 32, NMSpec(1, 4, "row"), seed=9)
    a = refresh(weights, meta, zeta0=0.5, rowwise_selection="group_full")
    b = refresh(weights, meta, zeta0=0.5, rowwise_selection="link_survivors")
    assert torch.equal(a.meta.codes, b.meta.codes) and torch.equal(a.new_values, b.new_values)
    assert a.stats == b.stats


@pytest.mark.parametrize("n", [2, 3])
def test_link_survivors_removes_the_weakest_links_and_keeps_the_rest_in_place(n):
    spec = NMSpec(n, 4, "row")
    weights, meta = make_matrix(8, 32, spec, seed=n)
    res = refresh(weights, meta, zeta0=0.5, selection="hard", rowwise_selection="link_survivors")
    old_mask, new_mask = decode(meta), decode(res.meta)
    before = dense(weights, meta)
    count = math.floor(zeta_at(10, T_END, 0.5) * weights.numel() + 0.5)
    weakest = torch.sort(weights.abs().view(-1), stable=True).indices[:count]
    removed_flat = old_mask.view(-1).nonzero().view(-1)[weakest]
    survivors = old_mask.clone()
    survivors.view(-1)[removed_flat] = False
    assert bool(new_mask[survivors].all())                         # every survivor still active ...
    assert torch.equal(dense(res.new_values, res.meta)[survivors], before[survivors])   # ... with its weight
    assert res.stats["groups_selected"] == len(set((removed_flat // 4).tolist()))


def test_swi_init_draws_new_links_from_the_sparse_weight_init_normal():
    spec = NMSpec(1, 4, "row")
    weights, meta = make_matrix(64, 256, spec, seed=3)
    res = refresh(weights, meta, step=0, zeta0=1.0, mpr_rho=1.0, new_weight_init="swi")
    fresh = res.slots < 0
    assert int(fresh.sum()) == weights.numel()                     # zeta0 = 1, rho = 1: every link moves
    std = float(res.new_values.view(-1)[fresh].std())
    assert std == pytest.approx(math.sqrt(2.0 / (spec.density * 256)), rel=0.05)


# --- determinism ----------------------------------------------------------------------------------------------

def model_matrices():
    shapes = {"layers.0.q": (16, 32, NMSpec(1, 4, "row")), "layers.0.up": (32, 16, NMSpec(2, 4, "row")),
              "layers.1.q": (16, 32, NMSpec(1, 4, "block")), "layers.1.down": (16, 48, NMSpec(2, 4, "block"))}
    return {name: make_matrix(o, i, spec, seed=k) for k, (name, (o, i, spec)) in enumerate(shapes.items())}


def refresh_all(matrices, names):
    return {name: refresh(*matrices[name], step=40, seed=123, name=name, zeta0=0.3, regrow="sample",
                          new_weight_init="swi") for name in names}


def test_refresh_is_bit_identical_twice_and_when_split_across_two_ranks():
    matrices = model_matrices()
    names = list(matrices)
    one_rank = refresh_all(matrices, names)
    again = refresh_all(matrices, names)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)              # a second rank usually runs with fewer threads
        torch.rand(1000)                      # and has consumed other random numbers
        rank1 = refresh_all(matrices, names[1::2][::-1])
    finally:
        torch.set_num_threads(threads)
    rank0 = refresh_all(matrices, names[0::2])
    for name in names:
        for other in (again[name], {**rank0, **rank1}[name]):
            ref = one_rank[name]
            assert torch.equal(ref.meta.codes, other.meta.codes), name
            assert torch.equal(ref.slots, other.slots) and torch.equal(ref.new_values, other.new_values), name
            assert ref.stats == other.stats, name


def test_refresh_generator_is_a_pinned_hash_of_seed_step_and_name():
    # Pinned: Python's hash() of a str changes with every process (PYTHONHASHSEED), sha256 does not, so a
    # resumed run and every rank derive the same draws.
    gen = refresh_generator(7, 300, "layers.3.mlp.up_proj")
    assert gen.initial_seed() == 4342749342155630533
    assert torch.equal(torch.rand(3, generator=gen),
                       torch.rand(3, generator=torch.Generator().manual_seed(4342749342155630533)))
    others = {refresh_generator(7, 400, "layers.3.mlp.up_proj").initial_seed(),
              refresh_generator(8, 300, "layers.3.mlp.up_proj").initial_seed(),
              refresh_generator(7, 300, "layers.3.mlp.down_proj").initial_seed()}
    assert gen.initial_seed() not in others and len(others) == 3


# --- errors ---------------------------------------------------------------------------------------------------

def test_check_legal_names_the_matrix_with_an_illegal_mask():
    _, meta = make_matrix(4, 8, NMSpec(2, 4, "row"), seed=0)
    bad = NMMeta(torch.zeros_like(meta.codes), meta.spec, meta.shape)     # positions 0, 0: not distinct
    with pytest.raises(RuntimeError, match="layers.2.self_attn.q_proj"):
        check_legal(bad, "layers.2.self_attn.q_proj")
    _, meta = make_matrix(4, 8, NMSpec(1, 4, "block"), seed=0)
    with pytest.raises(RuntimeError, match="down_proj"):
        check_legal(NMMeta(torch.full_like(meta.codes, 200), meta.spec, meta.shape), "down_proj")


@pytest.mark.parametrize("key,value", [("zeta0", 0.0), ("selection", "top"), ("rowwise_selection", "links"),
                                       ("score", "ch1"), ("regrow", "topk"), ("mpr_rho", 1.5),
                                       ("chunk_size", 0), ("new_weight_init", "kaiming"),
                                       ("temperature_end", 0.0)])
def test_bad_refresh_params_are_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"{key}: got"):
        RefreshParams(**{key: value})


def test_refresh_refuses_link_survivors_on_blocks_steps_after_t_end_and_wrong_weights():
    weights, meta = make_matrix(8, 8, NMSpec(1, 4, "block"), seed=0)
    with pytest.raises(ValueError, match="rowwise_selection: got 'link_survivors'"):
        refresh(weights, meta, rowwise_selection="link_survivors")
    with pytest.raises(ValueError, match="step: got 101"):
        refresh(weights, meta, step=101)
    with pytest.raises(ValueError, match=r"weights: got shape \(8, 1\)"):
        refresh(weights[:, :1], meta)
