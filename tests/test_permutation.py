"""BlockPermutation and its math (issue 8 items 1 and 5) against float64 references, brute force and dense paths."""

import io
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.permutation_math import (
    distance_from_identity, doubly_stochastic, hungarian, l1_l2_penalty, perm_lambda, per_row_penalty,
)


def reference_penalty(block: np.ndarray) -> float:
    """Seed Eq. 2 in float64, row by row and column by column."""
    total = 0.0
    for vec in list(block) + list(block.T):
        total += np.abs(vec).sum() - math.sqrt((vec ** 2).sum())
    return total


def permutation_theta(perms: list[list[int]]) -> torch.Tensor:
    """[nb, b, b] blocks with theta[k, i, perms[k][i]] = 1 (the convention Pi[i, perm[i]] = 1)."""
    b = len(perms[0])
    theta = torch.zeros(len(perms), b, b)
    for k, perm in enumerate(perms):
        theta[k, torch.arange(b), torch.tensor(perm)] = 1.0
    return theta


def dense_reference(layer: BlockPermutation) -> torch.Tensor:
    """[d, d] operator built with autograd from soft blocks and one-hot hard rows, independent of forward."""
    b, rows = layer.block_size, []
    blocks = layer.soft_blocks()
    for k in range(layer.num_blocks):
        if layer.hard_mask[k]:
            local = layer.hard_perm[k * b:(k + 1) * b] - k * b
            rows.append(torch.nn.functional.one_hot(local, b).float())
        else:
            rows.append(blocks[k])
    return torch.block_diag(*rows)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7).flatmap(lambda b: st.lists(st.permutations(range(b)), min_size=1, max_size=4)))
def test_penalty_is_zero_exactly_on_permutation_matrices(perms):
    assert torch.equal(l1_l2_penalty(permutation_theta(perms)), torch.zeros(len(perms)))


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(2, 4), st.integers(0, 2**31 - 1))
def test_penalty_is_positive_on_doubly_stochastic_blocks_that_are_not_permutations(b, num_perms, seed):
    # A convex combination of distinct permutations with weights in (0, 1) is doubly stochastic, not one-hot.
    rng = np.random.default_rng(seed)
    perms = {tuple(rng.permutation(b)) for _ in range(num_perms)}
    if len(perms) < 2:
        perms.add(tuple(np.roll(next(iter(perms)), 1)))  # a cyclic shift of a permutation differs from it
    weights = rng.uniform(0.1, 1.0, len(perms))
    weights /= weights.sum()
    block = sum(w * np.eye(b)[list(p)] for w, p in zip(weights, perms))
    got = l1_l2_penalty(torch.from_numpy(block)).item()
    assert got > 1e-3
    assert got == pytest.approx(reference_penalty(block), rel=1e-12)
    assert per_row_penalty(torch.from_numpy(block)).item() == pytest.approx(got / (2 * b), rel=1e-12)


@pytest.mark.parametrize("b", [1, 4, 64, 128])
def test_soft_blocks_are_doubly_stochastic_for_any_theta(b):
    gen = torch.Generator().manual_seed(b)
    shape = (6, b, b)
    thetas = [
        torch.randn(shape, generator=gen),
        torch.zeros(shape),
        torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.05),
        torch.eye(b) + 1e-3 * torch.randn(shape, generator=gen),
        1e6 * torch.randn(shape, generator=gen),
        torch.triu(torch.ones(shape)),  # no total support: Sinkhorn alone converges like 1/k
    ]
    for theta in thetas:
        for num_iters in (1, 5):
            blocks = doubly_stochastic(theta, num_iters)
            assert blocks.dtype == torch.float32 and blocks.min() >= 0
            assert (blocks.sum(-1) - 1).abs().max() < 1e-5
            assert (blocks.sum(-2) - 1).abs().max() < 1e-5


def test_doubly_stochastic_leaves_a_doubly_stochastic_block_unchanged():
    gen = torch.Generator().manual_seed(0)
    perms = [torch.randperm(8, generator=gen) for _ in range(3)]
    block = sum(w * torch.eye(8)[p] for w, p in zip((0.5, 0.3, 0.2), perms)).unsqueeze(0)
    assert torch.allclose(doubly_stochastic(block, 1), block, atol=1e-6)


def test_every_unhardened_block_stays_doubly_stochastic_after_three_adamw_steps():
    torch.manual_seed(0)
    layer = BlockPermutation(32, 8, seed=3)
    hard = torch.tensor([False, True, False, False])
    layer.harden(hard)
    hard_perm = layer.hard_perm.clone()
    # A large lr moves theta far (sign flips included); weight decay checks that nothing projects theta.
    opt = torch.optim.AdamW(layer.parameters(), lr=0.2, weight_decay=0.1)
    x, target = torch.randn(16, 32), torch.randn(16, 32)
    for step in range(3):
        loss = ((layer(x) - target) ** 2).mean() + perm_lambda(step + 1, 0.5, 3) * layer.penalty()
        opt.zero_grad()
        loss.backward()
        assert torch.equal(layer.theta.grad[hard], torch.zeros_like(layer.theta.grad[hard]))
        assert layer.theta.grad[~hard].abs().sum() > 0
        opt.step()
        blocks = layer.soft_blocks(torch.nonzero(~hard).squeeze(1))
        assert blocks.min() >= 0
        assert (blocks.sum(-1) - 1).abs().max() < 1e-5
        assert (blocks.sum(-2) - 1).abs().max() < 1e-5
    assert torch.equal(layer.hard_perm, hard_perm)


def test_hardening_returns_the_hungarian_optimum_found_by_brute_force():
    layer = BlockPermutation(15, 5, seed=0)
    with torch.no_grad():
        layer.theta.copy_(torch.rand(3, 5, 5, generator=torch.Generator().manual_seed(1)))
    blocks = layer.soft_blocks().detach().double()
    layer.harden_all()
    for k in range(3):
        scores = {p: sum(blocks[k, i, p[i]].item() for i in range(5)) for p in itertools.permutations(range(5))}
        best = max(scores, key=scores.get)
        assert layer.hard_perm[5 * k:5 * (k + 1)].tolist() == [5 * k + j for j in best]
    assert torch.equal(hungarian(blocks), layer.hard_perm.view(3, 5) - 5 * torch.arange(3).unsqueeze(1))


def test_gather_and_soft_matrix_paths_agree_for_a_hard_permutation():
    perms = [[2, 0, 3, 1], [0, 1, 2, 3], [3, 2, 1, 0]]
    layer = BlockPermutation(12, 4)
    with torch.no_grad():
        layer.theta.copy_(permutation_theta(perms))
    x = torch.randn(2, 5, 12, requires_grad=True)
    grad_y = torch.randn(2, 5, 12)
    y_soft = layer(x)
    (grad_soft,) = torch.autograd.grad(y_soft, x, grad_y)
    layer.harden_all()
    expected = torch.tensor([4 * k + j for k, perm in enumerate(perms) for j in perm])
    assert torch.equal(layer.perm_indices(), expected)
    y_hard = layer(x)
    (grad_hard,) = torch.autograd.grad(y_hard, x, grad_y)
    assert torch.allclose(y_soft, y_hard, atol=1e-6)
    assert torch.allclose(grad_soft, grad_hard, atol=1e-6)
    assert torch.equal(y_hard, x[..., expected])  # y_i = x_{perm[i]}
    inverse = torch.empty_like(expected)
    inverse[expected] = torch.arange(12)
    assert torch.equal(grad_hard, grad_y[..., inverse])


def test_mixed_hard_and_soft_blocks_match_the_dense_reference():
    layer = BlockPermutation(24, 6, seed=5)
    with torch.no_grad():
        layer.theta.add_(torch.rand(4, 6, 6, generator=torch.Generator().manual_seed(2)))
    layer.harden(torch.tensor([True, False, True, False]))
    x = torch.randn(3, 24, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(3, 24, dtype=torch.float64)
    y = layer(x.float())
    grad_x, grad_theta = torch.autograd.grad(y, (x, layer.theta), grad_y.float())
    dense = dense_reference(layer).double()
    y_ref = x @ dense.T
    grad_x_ref, grad_theta_ref = torch.autograd.grad(y_ref, (x, layer.theta), grad_y)
    assert torch.allclose(y.double(), y_ref, atol=1e-5)
    assert torch.allclose(grad_x, grad_x_ref, atol=1e-5)
    assert torch.allclose(grad_theta, grad_theta_ref.float(), atol=1e-5)
    assert torch.allclose(layer.permutation_matrix().double(), dense.detach())
    assert torch.equal(grad_theta[[0, 2]], torch.zeros(2, 6, 6))


def test_penalty_sums_the_soft_blocks_only_and_vanishes_when_all_are_hard():
    layer = BlockPermutation(12, 4, seed=1)
    blocks = layer.soft_blocks().detach().double().numpy()
    assert layer.penalty().item() == pytest.approx(sum(reference_penalty(b) for b in blocks), rel=1e-5)
    layer.harden(torch.tensor([True, False, False]))
    assert layer.penalty().item() == pytest.approx(sum(reference_penalty(b) for b in blocks[1:]), rel=1e-5)
    expected = [0.0] + [reference_penalty(b) / 8 for b in blocks[1:]]
    assert layer.penalty_per_row().tolist() == pytest.approx(expected, rel=1e-5)
    layer.harden_all()
    assert layer.penalty().item() == 0.0


def test_harden_ready_selects_soft_blocks_whose_per_row_penalty_is_below_delta():
    layer = BlockPermutation(12, 4, seed=0)
    with torch.no_grad():
        layer.theta[0] = torch.eye(4)[[1, 0, 3, 2]] + 0.01                 # near a permutation
        layer.theta[2] = torch.eye(4)[[3, 2, 1, 0]] + 0.01
    # Per-row penalty at the default init is about 1 - sqrt(0.625^2 + 3 * 0.125^2) = 0.34 at b = 4.
    assert layer.harden_ready(0.22).tolist() == [True, False, True]
    layer.harden(torch.tensor([True, False, False]))
    assert layer.harden_ready(0.22).tolist() == [False, False, True]
    assert layer.hard_perm[:4].tolist() == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="delta: got 0"):
        layer.harden_ready(0)


def test_all_hard_forward_leaves_theta_without_gradient():
    layer = BlockPermutation(8, 4)
    layer.harden_all()
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.theta.grad is None and torch.equal(x.grad, torch.ones(2, 8))


def test_state_dict_round_trip_restores_hardening():
    layer = BlockPermutation(16, 4, seed=7)
    with torch.no_grad():
        layer.theta.add_(torch.rand(4, 4, 4, generator=torch.Generator().manual_seed(3)))
    layer.harden(torch.tensor([False, True, True, False]))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    restored = BlockPermutation(16, 4, seed=8)
    x = torch.randn(5, 16)
    restored(x)  # builds the routing cache of the all-soft state, which loading must drop
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert set(layer.state_dict()) == {"theta", "hard_mask", "hard_perm"}
    assert torch.equal(restored.hard_mask, layer.hard_mask) and torch.equal(restored.hard_perm, layer.hard_perm)
    assert torch.equal(restored(x), layer(x))
    restored.harden_all()
    layer.harden_all()
    assert torch.equal(restored.perm_indices(), layer.perm_indices())


def test_identity_mode_returns_the_input_and_has_no_parameters():
    layer = BlockPermutation(8, 4, mode="identity")
    x = torch.randn(3, 8)
    assert layer(x) is x
    assert list(layer.parameters()) == []
    assert torch.equal(layer.perm_indices(), torch.arange(8))
    assert layer.metrics() == {"penalty": 0.0, "fraction_hardened": 1.0, "distance_from_identity": 1.0}


def test_random_mode_is_a_seeded_block_diagonal_gather():
    layer = BlockPermutation(32, 8, mode="random", seed=11)
    perm = layer.perm_indices()
    assert list(layer.parameters()) == []
    assert torch.equal(perm, BlockPermutation(32, 8, mode="random", seed=11).perm_indices())
    assert not torch.equal(perm, BlockPermutation(32, 8, mode="random", seed=12).perm_indices())
    for k in range(4):
        assert sorted(perm[8 * k:8 * (k + 1)].tolist()) == list(range(8 * k, 8 * (k + 1)))
    x = torch.randn(2, 3, 32, requires_grad=True)
    grad_y = torch.randn(2, 3, 32)
    y = layer(x)
    assert torch.equal(y, x[..., perm])
    assert torch.equal(torch.autograd.grad(y, x, grad_y)[0], torch.autograd.grad(x[..., perm], x, grad_y)[0])
    assert torch.equal(x[..., perm][..., layer.inverse_indices()], x)


def test_permutation_matrix_follows_the_convention_pi_i_perm_i_is_one():
    layer = BlockPermutation(12, 4, mode="random", seed=2)
    perm, dense = layer.perm_indices(), layer.permutation_matrix()
    assert torch.equal(dense[torch.arange(12), perm], torch.ones(12)) and dense.sum() == 12
    x = torch.randn(12)
    assert torch.equal(dense @ x, layer(x))


def test_distance_from_identity_matches_the_dense_formula():
    gen = torch.Generator().manual_seed(0)
    for perm in (torch.arange(10), torch.randperm(10, generator=gen), torch.roll(torch.arange(10), 1)):
        dense = torch.eye(10)[perm].double()
        expected = 1 - torch.linalg.matrix_norm(dense - torch.eye(10, dtype=torch.float64)).item() / math.sqrt(20)
        assert distance_from_identity(perm) == pytest.approx(expected, abs=1e-12)
    layer = BlockPermutation(8, 4, seed=0)
    with torch.no_grad():
        layer.theta[1] = torch.eye(4)[[1, 0, 2, 3]] + 0.05             # projects to one swap: 2 of 8 moved
    assert layer.distance_from_identity() == pytest.approx(1 - math.sqrt(2 / 8))
    assert not layer.hard_mask.any()  # projecting for the metric does not harden


def test_perm_indices_refuses_a_layer_with_soft_blocks():
    layer = BlockPermutation(8, 4)
    layer.harden(torch.tensor([True, False]))
    with pytest.raises(RuntimeError, match="1 of 2 blocks are still soft"):
        layer.perm_indices()


def test_block_size_not_dividing_d_raises_naming_both():
    with pytest.raises(ValueError, match=r"block_size: got 5 for d=12"):
        BlockPermutation(12, 5)
    with pytest.raises(ValueError, match="mode: got 'sorted'"):
        BlockPermutation(12, 4, mode="sorted")


def test_meta_device_layer_materializes_to_the_same_state():
    eager = BlockPermutation(16, 4, seed=9)
    lazy = BlockPermutation(16, 4, seed=9, device="meta").to_empty(device="cpu")
    lazy.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), lazy.state_dict().values()))


def test_perm_lambda_ramps_linearly_from_zero_then_holds():
    assert [perm_lambda(s, 0.01, 4) for s in (0, 1, 2, 4, 9)] == pytest.approx([0.0, 0.0025, 0.005, 0.01, 0.01])
    with pytest.raises(ValueError, match="t_perm: got 0"):
        perm_lambda(1, 0.01, 0)
    with pytest.raises(ValueError, match="step: got -1"):
        perm_lambda(-1, 0.01, 4)
