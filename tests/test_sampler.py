"""GlobalBatchSampler, validation_batches and collate: pure order, exact resume, world-size independence."""

import itertools

import pytest
import torch

from distsparse.data import GlobalBatchSampler, collate, validation_batches


def _take(sampler, num_micro_batches):
    return list(itertools.islice(iter(sampler), num_micro_batches))


def _global_batches(num_samples, micro_batch, grad_accum, world_size, seed, num_batches):
    """Per global batch, the list of every rank's micro-batches, from one sampler per rank."""
    per_rank = [_take(GlobalBatchSampler(num_samples, micro_batch, grad_accum, world_size, r, seed),
                      grad_accum * num_batches) for r in range(world_size)]
    return [[mb for r in range(world_size) for mb in per_rank[r][b * grad_accum: (b + 1) * grad_accum]]
            for b in range(num_batches)]


def test_order_is_a_pure_function_of_seed_and_epoch():
    a, b = GlobalBatchSampler(50, 2, 2, 2, 0, seed=7), GlobalBatchSampler(50, 2, 2, 2, 0, seed=7)
    assert torch.equal(a.epoch_order(3), b.epoch_order(3))
    assert sorted(a.epoch_order(0).tolist()) == list(range(50))
    orders = {tuple(GlobalBatchSampler(50, 2, 2, 2, 0, seed=s).epoch_order(e).tolist())
              for s, e in itertools.product(range(3), range(3))}
    assert len(orders) == 9  # (seed 0, epoch 1) differs from (seed 1, epoch 0) too
    assert _take(a, 40) == _take(b, 40)


def test_micro_step_a_of_rank_r_takes_slice_a_times_world_plus_r_of_the_global_batch():
    micro_batch, grad_accum, world_size, num_samples = 2, 3, 2, 30  # G = 12: 2 global batches per epoch
    g = micro_batch * grad_accum * world_size
    for rank in range(world_size):
        sampler = GlobalBatchSampler(num_samples, micro_batch, grad_accum, world_size, rank, seed=1)
        got = _take(sampler, grad_accum * 5)  # 5 global batches: crosses two epoch boundaries
        for step in range(5):
            epoch, batch = divmod(step, num_samples // g)
            order = sampler.epoch_order(epoch).tolist()
            for a in range(grad_accum):
                start = batch * g + (a * world_size + rank) * micro_batch
                assert got[step * grad_accum + a] == order[start: start + micro_batch]


def test_resume_from_consumed_samples_continues_the_same_stream():
    args = dict(num_samples=23, micro_batch=2, grad_accum=2, world_size=2, rank=1, seed=3)  # G = 8, 2 per epoch
    stream = _take(GlobalBatchSampler(**args), 2 * 7)
    for done in range(7):
        resumed = GlobalBatchSampler(**args, consumed_samples=done * 8)
        assert _take(resumed, 2 * (7 - done)) == stream[2 * done:]
        loaded = GlobalBatchSampler(**args)
        loaded.load_state_dict({"consumed_samples": done * 8})
        assert _take(loaded, 2) == stream[2 * done: 2 * done + 2]


def test_state_counts_a_global_batch_once_its_last_micro_batch_is_handed_out():
    sampler = GlobalBatchSampler(40, 2, 3, 1, 0, seed=0)  # G = 6
    it = iter(sampler)
    counts = []
    for _ in range(7):
        next(it)
        counts.append(sampler.state_dict()["consumed_samples"])
    assert counts == [0, 0, 6, 6, 6, 12, 12]
    assert sampler.epoch == 0 and GlobalBatchSampler(40, 2, 3, 1, 0, 0, consumed_samples=36).epoch == 1


def test_global_batch_sets_are_the_same_for_world_2_accum_1_and_world_1_accum_2():
    layouts = [dict(micro_batch=2, grad_accum=1, world_size=2), dict(micro_batch=2, grad_accum=2, world_size=1),
               dict(micro_batch=1, grad_accum=4, world_size=1), dict(micro_batch=1, grad_accum=1, world_size=4)]
    sets = [[sorted(sum(batch, [])) for batch in _global_batches(18, seed=5, num_batches=10, **layout)]
            for layout in layouts]  # 4 global batches per epoch: 10 cross two epoch boundaries
    assert sets[0] == sets[1] == sets[2] == sets[3]


def test_ranks_of_a_global_batch_are_disjoint_and_cover_it_and_an_epoch_drops_its_last_partial_batch():
    num_samples, seed = 29, 11  # G = 12: 2 global batches per epoch, 5 samples dropped each epoch
    batches = _global_batches(num_samples, micro_batch=2, grad_accum=2, world_size=3, seed=seed, num_batches=4)
    order = GlobalBatchSampler(num_samples, 2, 2, 3, 0, seed).epoch_order
    for step, batch in enumerate(batches):
        flat = sum(batch, [])
        assert len(flat) == len(set(flat)) == 12
        epoch, b = divmod(step, 2)
        assert set(flat) == set(order(epoch)[b * 12: (b + 1) * 12].tolist())
    epoch0 = sum(batches[0] + batches[1], [])
    assert len(set(epoch0)) == 24 and set(epoch0) == set(order(0)[:24].tolist())


def test_validation_batches_give_every_sample_to_exactly_one_rank_in_micro_batches():
    for num_samples, micro_batch, world_size, max_samples in itertools.product(
            (1, 7, 12), (1, 3, 4), (1, 2, 3), (None, 5)):
        total = num_samples if max_samples is None else min(num_samples, max_samples)
        per_rank = [validation_batches(num_samples, micro_batch, world_size, r, max_samples)
                    for r in range(world_size)]
        flat = sorted(i for batches in per_rank for batch in batches for i in batch)
        assert flat == list(range(total))
        assert all(1 <= len(batch) <= micro_batch for batches in per_rank for batch in batches)
        assert all(batch == list(range(batch[0], batch[0] + len(batch))) for b in per_rank for batch in b)
        assert per_rank == [validation_batches(num_samples, micro_batch, world_size, r, max_samples)
                            for r in range(world_size)]


def test_collate_stacks_the_samples_of_a_micro_batch():
    data = [{"input_ids": torch.arange(3) + 10 * i, "labels": torch.full((3,), i)} for i in range(5)]
    batch = collate(data, [4, 1])
    assert batch["input_ids"].tolist() == [[40, 41, 42], [10, 11, 12]]
    assert batch["labels"].tolist() == [[4, 4, 4], [1, 1, 1]]


def test_bad_sampler_inputs_raise_value_errors_naming_the_value():
    with pytest.raises(ValueError, match=r"consumed_samples: got 5; allowed: a non-negative multiple .* 8"):
        GlobalBatchSampler(100, 2, 2, 2, 0, seed=0, consumed_samples=5)
    with pytest.raises(ValueError, match=r"global batch .* = 24\) exceeds the 20 samples"):
        GlobalBatchSampler(20, 4, 3, 2, 0, seed=0)
    with pytest.raises(ValueError, match=r"rank: got 2; allowed: 0 <= rank < world_size \(2\)"):
        GlobalBatchSampler(100, 2, 2, 2, 2, seed=0)
    with pytest.raises(ValueError, match=r"grad_accum: got 0; allowed: >= 1"):
        GlobalBatchSampler(100, 2, 0, 2, 0, seed=0)
    with pytest.raises(ValueError, match=r"micro_batch: got 0"):
        validation_batches(10, 0, 1, 0)
