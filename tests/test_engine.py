"""The matrix engine: owner maps, sharded == replicated in both gradient accumulation modes, k x 1 == 1 x k,
exact resume, state moves on refresh (reset modes of paper Table A8)."""

import torch

import pytest

from distsparse.config import TopologyConfig, load_config
from distsparse.models import backbone_param, build_model, projection_names
from distsparse.nm import NMMeta, decode, encode, kept_index, move_slots, random_mask, scatter_kept, slot_map
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.owners import assign_owners, rank_loads
from distsparse.optim.rules import get_rule
from distsparse.topology import RefreshResult
from distsparse.train.topology_policy import TopologyPolicy


def _tiny(method: str, layers: int = 2):
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={method}", f"model.num_hidden_layers={layers}"])
    model = build_model(cfg.model, cfg.method, 97, seed=3)
    for p in model.parameters():
        p.requires_grad_(False)
    backbone = {n: model.get_submodule(n) for n in projection_names(model)}
    for m in backbone.values():
        backbone_param(m).requires_grad_(True)
    return cfg, model, backbone


def _steps(engine, model, rank, first, last, micro, topology, lr):
    """Optimizer steps first..last: each a batch of 2 sequences (seeded by rank and step), in `micro`
    micro-batches whose losses are scaled by 1 / micro (the mean over the batch, as DeepSpeed scales them)."""
    for step in range(first, last + 1):
        x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1000 * rank + step))
        for i, part in enumerate(x.chunk(micro)):
            engine.start_boundary() if i == micro - 1 else engine.start_micro_step()
            (model(input_ids=part, labels=part).loss / micro).backward()
            assert all(backbone_param(m).grad is None for m in engine.matrices.values() for m in [m.module])
        engine.reduce_gradients()
        engine.step(lr, refresh=topology.refresh_fn(step) if topology.due(step) else None)
        engine.zero_grad()


def _train(rank, world_size, method, mode, steps, layers=2, refresh_every=0, gather_chunk=1 << 24,
           reset_mode="changed", micro=1, resume=None, total=None, **engine_args):
    """Train to step `steps` (with `resume` = (saved, first): load a saved run and continue from step first) of a
    schedule of `total` steps (default `steps`)."""
    torch.manual_seed(0)
    cfg, model, backbone = _tiny(method, layers)
    hp = get_rule(cfg.method.rule).hparams(lr=cfg.method.lr)
    first = 1
    if resume is not None:
        saved, first = resume
        for name, m in backbone.items():
            backbone_param(m).data.copy_(saved["values"][name])
            if name in saved["codes"]:
                m.set_codes(saved["codes"][name])
    engine = MatrixEngine(backbone, rule=cfg.method.rule, hparams=hp, mode=mode, gather_chunk=gather_chunk,
                          reset_mode=reset_mode, micro_batches=micro, **engine_args)
    if resume is not None:
        engine.load_state_dict(saved["engine"])
    topology = TopologyPolicy(TopologyConfig(enabled=bool(refresh_every), update_interval=max(1, refresh_every)),
                              total_steps=total or steps, seed=7)
    _steps(engine, model, rank, first, steps, micro, topology, cfg.method.lr)
    values = {n: backbone_param(m).detach().clone() for n, m in backbone.items()}
    codes = {n: m.codes.clone() for n, m in backbone.items() if hasattr(m, "codes")}
    return values, engine.owners, engine.state_bytes(), codes, engine.grad_accum_mode, engine.state_dict()


def _run_modes(rank, world_size, method):
    return (_train(rank, world_size, method, "sharded", 20, 1, refresh_every=5),
            _train(rank, world_size, method, "replicated", 20, 1, refresh_every=5),
            _train(rank, world_size, method, "sharded", 20, 1, refresh_every=5, grad_accum_mode="full",
                   num_buckets=3, gather_chunk=4000),
            _train(rank, world_size, method, "sharded", 20, 1, refresh_every=5, reset_mode="none"),
            _train(rank, world_size, method, "replicated", 20, 1, refresh_every=5, reset_mode="none"),
            _train(rank, world_size, method, "sharded", 20, 1, refresh_every=5, grad_accum_mode="sharded",
                   bucket_bytes=4 * 2000))


def test_sharded_training_equals_replicated_on_two_ranks(ranks2):
    for method in ("chtsnm_nobranch_1of4_row",):
        (s0, r0, b0, n0, nr0, t0), (s1, r1, b1, n1, _, t1) = ranks2.run(_run_modes, method)
        assert (s0[4], b0[4], t0[4], r0[4]) == ("sharded", "full", "sharded", "full"), "auto: sharded at W = 2"
        assert s0[1] == s1[1], "owner maps differ between ranks"
        assert set(s0[1].values()) == {0, 1}
        for name in s0[0]:
            assert torch.equal(s0[0][name], s1[0][name]), f"{name}: ranks disagree"
            torch.testing.assert_close(s0[0][name], r0[0][name], rtol=0, atol=1e-6)
            # Full accumulation in 3 buckets reduced during the last backward (async), values gathered in chunks
            # (4000: the last one is partial and holds both ranks' data), and sharded accumulation in one bucket or
            # in buckets of about 2000 values (one reduce in flight while the next fills) hold bitwise the same
            # gradients at W = 2 with one micro-batch, so they train to the same bits.
            assert torch.equal(s0[0][name], b0[0][name]) and torch.equal(b0[0][name], b1[0][name]), name
            assert torch.equal(s0[0][name], t0[0][name]) and torch.equal(t0[0][name], t1[0][name]), name
        # Refreshes computed by owners (sharded) give the same masks as every rank computing all of them.
        for name in s0[3]:
            assert torch.equal(s0[3][name], s1[3][name]) and torch.equal(s0[3][name], r0[3][name]), name
        assert s0[2] < r0[2], "sharded state must be smaller than replicated"
        # Reset mode none: owners keep the dense shadows of their matrices; the result is the replicated one.
        for name in n0[0]:
            assert torch.equal(n0[0][name], n1[0][name]), f"{name}: ranks disagree (reset none)"
            torch.testing.assert_close(n0[0][name], nr0[0][name], rtol=0, atol=1e-6)
            assert torch.equal(n0[3][name], nr0[3][name]), name
        assert any(not torch.equal(n0[0][name], s0[0][name]) for name in n0[0]), "reset none changed nothing"


def test_one_rank_trains_without_collectives():
    values, owners, _, _, accum, _ = _train(0, 1, "chtsnm_nobranch_2of4_block", "sharded", 3)
    assert accum == "full", "auto: nothing to shard in a world of one"
    assert set(owners.values()) == {0}
    assert all(torch.isfinite(v).all() for v in values.values())


def _micro_batches_and_resume(rank, world_size, accum):
    method, args = "chtsnm_nobranch_1of4_row", {"refresh_every": 2, "grad_accum_mode": accum, "bucket_bytes": 4 * 2000}
    whole = _train(rank, world_size, method, "sharded", 6, 1, micro=2, **args)
    one_micro = _train(rank, world_size, method, "sharded", 6, 1, micro=1, **args)
    first = _train(rank, world_size, method, "sharded", 3, 1, micro=2, total=6, **args)
    saved = {"values": first[0], "codes": first[3], "engine": first[5]}
    resumed = _train(rank, world_size, method, "sharded", 6, 1, micro=2, resume=(saved, 4), **args)
    replicated = _train(rank, world_size, method, "replicated", 6, 1, micro=2, refresh_every=2)
    return whole, one_micro, resumed, replicated


def test_both_accumulation_modes_with_two_micro_batches_resume_exactly_and_match_one_micro_batch(ranks2):
    runs = {accum: ranks2.run(_micro_batches_and_resume, accum) for accum in ("full", "sharded")}
    for accum, ((whole, one_micro, resumed, replicated), (whole1, *_)) in runs.items():
        assert whole[4] == accum and replicated[4] == "full"
        for name, value in whole[0].items():
            assert torch.equal(value, whole1[0][name]), f"{accum} {name}: ranks disagree"
            # Exact resume: a run saved after step 3 and continued is bit-identical to the one that went on.
            assert torch.equal(value, resumed[0][name]), f"{accum} {name}: resume is not exact"
            assert torch.equal(whole[3].get(name, value), resumed[3].get(name, value)), f"{accum} {name}: codes"
            torch.testing.assert_close(value, replicated[0][name], rtol=0, atol=1e-6,
                                       msg=f"{accum} {name}: sharded != replicated")
            # k x 1 == 1 x k: two micro-batches of one sequence train like one micro-batch of two.
            torch.testing.assert_close(value, one_micro[0][name], rtol=0, atol=1e-6,
                                       msg=f"{accum} {name}: 2 micro-batches != 1")
    full, sharded = runs["full"][0][0], runs["sharded"][0][0]
    for name, value in full[0].items():   # the modes sum micro-batches and ranks in different orders
        torch.testing.assert_close(sharded[0][name], value, rtol=0, atol=1e-6, msg=f"{name}: sharded != full")
    assert sharded[2] < full[2], "sharded accumulation holds fewer gradient bytes"


def test_lpt_owner_map_is_deterministic_and_balanced():
    costs = {f"m{i}": float(c) for i, c in enumerate([9, 7, 7, 5, 5, 5, 3, 3, 1, 1])}
    owners = assign_owners(costs, 3)
    assert owners == assign_owners(dict(reversed(list(costs.items()))), 3)
    loads = rank_loads(costs, owners, 3)
    assert max(loads) - min(loads) <= max(costs.values())
    assert set(assign_owners(costs, 16).values()) == set(range(10)), "more ranks than matrices: idle owners"


def test_refresh_moves_master_and_state_with_links():
    cfg, model, backbone = _tiny("chtsnm_nobranch_2of4_row", layers=1)
    hp = get_rule("tans").hparams(lr=1e-3)
    engine = MatrixEngine(backbone, rule="tans", hparams=hp)
    x = torch.randint(0, 97, (2, 12))
    for _ in range(3):
        model(input_ids=x, labels=x).loss.backward()
        engine.step(1e-3)
        engine.zero_grad()
    name = sorted(backbone)[0]
    layer = backbone[name]
    old = NMMeta(layer.codes.clone(), layer.spec, (layer.out_features, layer.in_features))
    new = encode(random_mask(*old.shape, old.spec, torch.Generator().manual_seed(5)), old.spec)
    slots = slot_map(old, new)
    moved = torch.where(slots >= 0, engine.masters[name].reshape(-1)[slots.clamp(min=0)], torch.zeros(()))
    before = {k: engine.states[name][k].clone() for k in ("V", "P")}
    before_master = engine.masters[name].clone()

    def refresh(n, master, meta):
        if n != name:
            return RefreshResult(meta, slot_map(meta, meta), master.clone(), {})
        return RefreshResult(new, slots, moved.view_as(master), {})

    engine._refresh(refresh)
    assert torch.equal(layer.codes, new.codes)
    both = decode(old) & decode(new)
    for key, dense_before in (("V", before["V"]), ("P", before["P"]), ("master", before_master)):
        after = engine.masters[name] if key == "master" else engine.states[name][key]
        d_old = scatter_kept(dense_before, kept_index(old), old.shape)
        d_new = scatter_kept(after, kept_index(new), new.shape)
        assert torch.equal(d_old[both], d_new[both]), key
        assert (d_new[decode(new) & ~decode(old)] == 0).all(), key
    assert int(engine.states[name]["tau"]) == 0


def _random_refresh(step: int):
    """A refresh to a random legal pattern per matrix (seeded by step and name): many links leave and come back."""
    def refresh(name, master, meta):
        gen = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
        new = encode(random_mask(*meta.shape, meta.spec, gen), meta.spec)
        slots = slot_map(meta, new)
        return RefreshResult(new, slots, move_slots(master, slots), {})
    return refresh


@pytest.mark.parametrize("method", ["chtsnm_nobranch_1of4_row", "chtsnm_nobranch_2of4_block"])
def test_reset_none_gives_every_regrown_link_the_state_it_had_when_it_last_left(method):
    """Brute force in the dense frame: after each refresh a kept link holds its state, a link that was active
    before holds what it held when it last left, a link never active holds zero (paper App. I.3)."""
    cfg, model, backbone = _tiny(method, layers=1)
    engine = MatrixEngine(backbone, rule="tans", hparams=get_rule("tans").hparams(lr=1e-2), reset_mode="none")
    left = {n: {k: torch.zeros(m.out_features, m.in_features) for k in ("V", "P")} for n, m in backbone.items()}
    ever = {n: torch.zeros(m.out_features, m.in_features, dtype=torch.bool) for n, m in backbone.items()}
    gen = torch.Generator().manual_seed(4)
    returned = 0
    for step in range(1, 9):
        x = torch.randint(0, 97, (2, 12), generator=gen)
        model(input_ids=x, labels=x).loss.backward()
        before, random_refresh = {}, _random_refresh(step)

        def refresh(name, master, meta):   # called after the rule step, before the state moves: record it
            before[name] = (decode(meta), {k: scatter_kept(engine.states[name][k], kept_index(meta), meta.shape)
                                           for k in ("V", "P")})
            return random_refresh(name, master, meta)

        engine.step(1e-2, refresh=refresh if step % 2 == 0 else None)
        engine.zero_grad()
        for name, (old_mask, old_dense) in before.items():
            m = backbone[name]
            new_mask = decode(m.meta)
            back = new_mask & ~old_mask & ever[name]
            returned += int(back.sum())
            for key in ("V", "P"):
                after = scatter_kept(engine.states[name][key], kept_index(m.meta), m.meta.shape)
                want = torch.where(old_mask & new_mask, old_dense[key], torch.where(back, left[name][key], 0.0))
                assert torch.equal(after, want * new_mask), (name, step, key)
                gone = old_mask & ~new_mask
                left[name][key][gone] = old_dense[key][gone]
            ever[name] |= old_mask & ~new_mask
    assert returned > 0, "test setup: links must come back"


def test_reset_none_shadows_travel_with_the_state_dict():
    _, model, backbone = _tiny("chtsnm_nobranch_1of4_row", layers=1)
    hp = get_rule("tans").hparams(lr=1e-2)
    engine = MatrixEngine(backbone, rule="tans", hparams=hp, reset_mode="none")
    x = torch.randint(0, 97, (2, 12))
    for step in (1, 2):
        model(input_ids=x, labels=x).loss.backward()
        engine.step(1e-2, refresh=_random_refresh(step))
        engine.zero_grad()
    saved = engine.state_dict()
    fresh = MatrixEngine(backbone, rule="tans", hparams=hp, reset_mode="none")
    fresh.load_state_dict(saved)
    for name, shadow in engine.shadows.items():
        assert shadow["V"].count_nonzero() > 0
        assert all(torch.equal(t, fresh.shadows[name][k]) for k, t in shadow.items()), name
    name = sorted(saved)[0]
    saved[name] = {k: v for k, v in saved[name].items() if not k.startswith("shadow.")}
    with pytest.raises(KeyError, match="reset mode 'none' needs its shadow"):
        fresh.load_state_dict(saved)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")], ids=["finite", "nan", "inf", "-inf"])
def test_local_grads_nonfinite_flags_any_nan_or_inf_and_takes_empty_buffers(bad):
    # 0 for finite gradients (huge ones included: finiteness, not a norm that could overflow), inf for any nan or
    # +-inf; a rank owning no matrix of a bucket holds an empty buffer, which must not raise (its ranks would hang).
    _, _, backbone = _tiny("chtsnm_nobranch_1of4_row", layers=1)
    engine = MatrixEngine(backbone, rule="tans", hparams=get_rule("tans").hparams(lr=1e-3))
    own = engine.grads.own()
    for i, t in enumerate(own):
        t.fill_(3e38 if i == 0 else 1.0)
    if bad is not None:
        own[-1].view(-1)[own[-1].numel() // 2] = bad
    engine.grads.own = lambda: [torch.empty(0), *own]
    expected = 0.0 if bad is None else float("inf")
    assert engine.local_grads_nonfinite().item() == expected
    engine.grads.own = lambda: [torch.empty(0)]
    assert engine.local_grads_nonfinite().item() == 0.0


def test_an_unknown_reset_mode_is_refused_when_the_engine_is_built():
    _, _, backbone = _tiny("chtsnm_nobranch_1of4_row", layers=1)
    with pytest.raises(ValueError, match="reset_mode: got 'some'; allowed: changed, all, none"):
        MatrixEngine(backbone, rule="tans", hparams=get_rule("tans").hparams(lr=1e-2), reset_mode="some")
