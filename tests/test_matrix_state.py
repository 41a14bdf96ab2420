"""State moves across topology refreshes (DESIGN decision 11), checked by brute force in the dense frame."""

import pytest
import torch

from distsparse.nm import NMSpec, encode, kept_index, mask_from_scores, random_mask, scatter_kept, slot_map
from distsparse.optim import TansHParams, init_shadow, init_state, move_state, step_tans, update_shadow

SHAPE = (16, 24)


def pattern(mask, spec):
    meta = encode(mask, spec)
    return meta, kept_index(meta)


def trained(spec, seed, num_steps=3):
    """A matrix with a random pattern and nonzero master, V, P, tau and step after a few TANS steps."""
    g = torch.Generator().manual_seed(seed)
    mask = random_mask(*SHAPE, spec, generator=g)
    meta, index = pattern(mask, spec)
    k = spec.kept_per_row(SHAPE[1])
    master = torch.randn(SHAPE[0], k, generator=g)
    state = init_state("tans", tuple(master.shape))
    for _ in range(num_steps):
        step_tans(master, torch.randn(SHAPE[0], k, generator=g), state, lr=0.01, hp=TansHParams(ramp_steps=2),
                  index=index, shape=SHAPE)
    return mask, meta, index, master, state


def nearby_mask(mask, spec, seed):
    """A different legal pattern that keeps most links of `mask` (scores favour the old support)."""
    noise = torch.rand(*SHAPE, generator=torch.Generator().manual_seed(seed))
    new = mask_from_scores(mask.float() + 2.5 * noise, spec.n, spec.layout)
    assert (new & mask).any() and (new & ~mask).any(), "test setup: need both survivors and regrown links"
    return new


def dense(values, index):
    return scatter_kept(values, index, SHAPE)


@pytest.mark.parametrize("layout", ["row", "block"])
def test_changed_mode_keeps_every_surviving_link_bit_identical_at_its_row_and_col(layout):
    spec = NMSpec(2, 4, layout)
    mask, meta, index, master, state = trained(spec, seed=1)
    new_mask = nearby_mask(mask, spec, seed=2)
    new_meta, new_index = pattern(new_mask, spec)
    new_master, new_state = move_state(state, master, slot_map(meta, new_meta), "changed")
    survivors, regrown = mask & new_mask, new_mask & ~mask
    for old, new in [(master, new_master), (state["V"], new_state["V"]), (state["P"], new_state["P"])]:
        before, after = dense(old, index), dense(new, new_index)
        assert torch.equal(after[survivors], before[survivors])
        assert torch.count_nonzero(after[regrown]) == 0
        assert torch.count_nonzero(after[~new_mask]) == 0
        assert torch.count_nonzero(before[survivors]) == int(survivors.sum())   # survivors carried real data
    assert int(new_state["tau"]) == 0 and int(new_state["step"]) == int(state["step"]) == 3


def test_all_mode_moves_the_weights_but_zeroes_every_moment_and_restarts_the_step_count():
    spec = NMSpec(2, 4, "row")
    mask, meta, index, master, state = trained(spec, seed=3)
    new_mask = nearby_mask(mask, spec, seed=4)
    new_meta, new_index = pattern(new_mask, spec)
    slots = slot_map(meta, new_meta)
    new_master, new_state = move_state(state, master, slots, "all")
    assert torch.equal(new_master, move_state(state, master, slots, "changed")[0])
    assert torch.count_nonzero(new_state["V"]) == 0 and torch.count_nonzero(new_state["P"]) == 0
    assert int(new_state["tau"]) == 0 and int(new_state["step"]) == 0


def test_none_mode_gives_regrown_links_the_state_they_had_when_they_left():
    spec = NMSpec(2, 4, "row")
    hp = TansHParams()
    mask_a, meta_a, index_a, master, state = trained(spec, seed=5)
    shadow = init_shadow(state, SHAPE)
    k = master.shape[1]
    # refresh 1: A -> B; record what every link of A holds as it leaves
    mask_b = nearby_mask(mask_a, spec, seed=6)
    meta_b, index_b = pattern(mask_b, spec)
    left_v, left_p = dense(state["V"], index_a), dense(state["P"], index_a)
    update_shadow(shadow, index_a, state)
    master, state = move_state(state, master, slot_map(meta_a, meta_b), "none", shadow=shadow, new_index=index_b)
    step_tans(master, torch.randn(SHAPE[0], k), state, lr=0.01, hp=hp, index=index_b, shape=SHAPE)
    # refresh 2: B -> A again: links of A \ B come back with their old moments, the rest is as in `changed`
    before_v, before_p = dense(state["V"], index_b), dense(state["P"], index_b)
    update_shadow(shadow, index_b, state)
    slots = slot_map(meta_b, meta_a)
    new_master, new_state = move_state(state, master, slots, "none", shadow=shadow, new_index=index_a)
    returned, stayed = mask_a & ~mask_b, mask_a & mask_b
    after_v, after_p = dense(new_state["V"], index_a), dense(new_state["P"], index_a)
    assert torch.equal(after_v[returned], left_v[returned]) and torch.equal(after_p[returned], left_p[returned])
    assert torch.count_nonzero(left_v[returned]) == int(returned.sum())
    assert torch.equal(after_v[stayed], before_v[stayed]) and torch.equal(after_p[stayed], before_p[stayed])
    assert torch.count_nonzero(dense(new_master, index_a)[returned]) == 0   # weights still restart at zero
    assert int(new_state["tau"]) == 0


def test_after_a_move_the_next_tans_step_is_the_pure_base_update():
    spec = NMSpec(1, 4, "block")
    mask, meta, index, master, state = trained(spec, seed=7)
    new_meta, new_index = pattern(nearby_mask(mask, spec, seed=8), spec)
    grad = torch.randn(SHAPE[0], master.shape[1], generator=torch.Generator().manual_seed(9))

    def one_step(master, state, index, hp):
        m, s = master.clone(), {key: t.clone() for key, t in state.items()}
        step_tans(m, grad, s, lr=0.01, hp=hp, index=index, shape=SHAPE)
        return m

    ramped, base = TansHParams(gamma_ns=1.0, ramp_steps=2), TansHParams(gamma_ns=0.0)
    assert not torch.equal(one_step(master, state, index, ramped), one_step(master, state, index, base))  # tau 3
    master, state = move_state(state, master, slot_map(meta, new_meta))
    assert torch.equal(one_step(master, state, new_index, ramped), one_step(master, state, new_index, base))


def test_move_state_leaves_its_inputs_untouched_and_refuses_bad_modes():
    spec = NMSpec(2, 4, "row")
    mask, meta, index, master, state = trained(spec, seed=9)
    new_meta, _ = pattern(nearby_mask(mask, spec, seed=10), spec)
    slots = slot_map(meta, new_meta)
    snapshot = {key: t.clone() for key, t in state.items()}
    move_state(state, master, slots, "all")
    assert all(torch.equal(state[key], snapshot[key]) for key in state)
    with pytest.raises(ValueError, match="reset_mode: got 'some'; allowed: changed, all, none"):
        move_state(state, master, slots, "some")
    with pytest.raises(ValueError, match="reset_mode: 'none' needs the dense shadow"):
        move_state(state, master, slots, "none")
