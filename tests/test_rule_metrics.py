"""TANS's statistics (issue 28 item 2): s, gamma_t, base and corrected update RMS per matrix against a float64
computation from the paper's equations, their mean/min/max per projection type merged over ranks, and a training run
that writes them to TensorBoard on logging steps only."""

import math
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.layers.llama_projections import PROJECTIONS
from distsparse.nm import kept_index, scatter_kept
from distsparse.optim.engine import MatrixEngine
from distsparse.train.deepspeed.config import build_ds_config
from distsparse.train.rule_metrics import rule_metrics
from synthetic_data import make_data_dir
from test_group_rules import grads_of, start_states, tiny_backbone
from test_rules import ns64

STATS = ("rms_scale", "ramp_gamma", "base_update_rms", "corrected_update_rms")


def _rms(x: torch.Tensor) -> float:
    return float(x.double().square().mean().sqrt())


def test_tans_statistics_equal_a_float64_computation_of_s_gamma_and_both_update_rms():
    """One logged step from a state whose tau differs per matrix (0..5, ramp 8: gamma 0 to 0.3125 in a group)."""
    cfg, backbone = tiny_backbone("chtsnm_nobranch_1of4_row")
    hp = cfg.method.rule_params
    start = start_states(backbone, "tans", seed=7)
    engine = MatrixEngine(backbone, rule="tans", hparams=hp)
    engine.load_state_dict({n: {k: v.clone() for k, v in e.items()} for n, e in start.items()})
    grads = grads_of(backbone, 0, 1)
    engine.start_boundary()
    for name, g in grads.items():
        engine.grads.add(name, g)
    engine.reduce_gradients()
    engine.step(1e-2, stats=True)
    stats = engine.rule_stats()
    assert set(stats) == set(backbone)
    b1, b2, eps = hp.beta1, hp.beta2, hp.eps
    for name, module in backbone.items():
        G, V0, P0 = (t.double() for t in (grads[name], start[name]["V"], start[name]["P"]))
        V = b2 * V0 + (1 - b2) * G ** 2
        Gh = G / (V.sqrt() + eps)
        U = (1 - b1) * Gh + b1 * (b1 * P0 + (1 - b1) * Gh)
        gamma = hp.gamma_ns * min(1.0, int(start[name]["tau"]) / hp.ramp_steps)
        index, shape = kept_index(module.meta), (module.out_features, module.in_features)
        dense = scatter_kept(U, index, shape)
        O_M = ns64(dense / (dense.norm() + eps), hp.ns_coefficients).reshape(-1)[index].view_as(U)
        s = _rms(U) / (_rms(O_M) + eps)
        corrected = U + gamma * (s * O_M - U)
        want = {"rms_scale": s, "ramp_gamma": gamma, "base_update_rms": _rms(U),
                "corrected_update_rms": _rms(corrected)}
        assert set(stats[name]) == set(STATS)
        for key, value in want.items():
            assert stats[name][key] == pytest.approx(value, rel=1e-4, abs=1e-12), (name, key)
    assert len({stats[n]["ramp_gamma"] for n in stats}) > 2, "gamma differs between matrices of a group"
    # One process: the merge is over this rank's matrices alone.
    metrics = rule_metrics(stats, "tans")
    for proj in PROJECTIONS:
        mine = [s for n, s in stats.items() if n.endswith(proj)]
        for key in STATS:
            values = [s[key] for s in mine]
            assert metrics[f"tans/{proj}/{key}_mean"] == pytest.approx(sum(values) / len(values), rel=1e-12)
            assert metrics[f"tans/{proj}/{key}_min"] == min(values)
            assert metrics[f"tans/{proj}/{key}_max"] == max(values)


def _merge(rank, world_size):
    # Rank 0 holds two q_proj matrices (one without an s), rank 1 one q_proj and one o_proj.
    stats = [{"l0.q_proj": {"rms_scale": 2.0, "ramp_gamma": 0.0}, "l1.q_proj": {"ramp_gamma": 0.5}},
             {"l2.q_proj": {"rms_scale": 4.0, "ramp_gamma": 0.25}, "l0.o_proj": {"ramp_gamma": 0.125}}][rank]
    return rule_metrics(stats, "tans")


def test_statistics_merge_over_ranks_counting_each_matrix_once(ranks2):
    m0, m1 = ranks2.run(_merge)
    assert m0 == m1
    assert m0 == {"tans/o_proj/ramp_gamma_mean": 0.125, "tans/o_proj/ramp_gamma_min": 0.125,
                  "tans/o_proj/ramp_gamma_max": 0.125,
                  "tans/q_proj/ramp_gamma_mean": 0.25, "tans/q_proj/ramp_gamma_min": 0.0,
                  "tans/q_proj/ramp_gamma_max": 0.5,
                  "tans/q_proj/rms_scale_mean": 3.0, "tans/q_proj/rms_scale_min": 2.0,
                  "tans/q_proj/rms_scale_max": 4.0}


BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000", "train.log_interval=2",
        "train.warmup_steps=1", "train.micro_batch=2", "method.preset=chtsnm_nobranch_1of4_row",
        "method.topology.update_interval=3", "train.steps=5"]


def _train(rank, world_size, data_dir, out_dir):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    trainer.train()
    trainer.close()


def test_a_run_writes_the_tans_statistics_to_tensorboard_on_logging_steps_only(ranks2, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    data_dir = make_data_dir(tmp_path / "data")
    ranks2.run(_train, data_dir, str(tmp_path / "run"))
    ea = EventAccumulator(str(Path(tmp_path / "run") / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    for proj in PROJECTIONS:
        for key in STATS:
            for agg in ("mean", "min", "max"):
                tag = f"tans/{proj}/{key}_{agg}"
                assert tag in tags, tag
                # Logged at steps 2, 4 (log_interval) and 5 (the last). The refresh of step 3 restarts tau, so step 4 is
                # a pure base step (gamma 0, no Newton-Schulz, no s) and steps 2 and 5 have gamma = 0.5 * 1 / 8.
                steps = {e.step: e.value for e in ea.Scalars(tag)}
                assert set(steps) == ({2, 5} if key == "rms_scale" else {2, 4, 5}), (tag, steps)
                assert all(math.isfinite(v) for v in steps.values()), tag
        gamma = {e.step: e.value for e in ea.Scalars(f"tans/{proj}/ramp_gamma_max")}
        assert gamma == pytest.approx({2: 0.0625, 4: 0.0, 5: 0.0625}), gamma


def _replicated_stats(rank, world_size):
    cfg, backbone = tiny_backbone("chtsnm_nobranch_1of4_row")
    engine = MatrixEngine(backbone, rule="tans", hparams=cfg.method.rule_params, mode="replicated")
    engine.load_state_dict(start_states(backbone, "tans", seed=1))
    engine.start_boundary()
    for name, g in grads_of(backbone, rank, 1).items():
        engine.grads.add(name, g)
    engine.reduce_gradients()
    engine.step(1e-2, stats=True)
    return sorted(engine.rule_stats()), sorted(m.name for m in engine.owned()), len(engine.masters)


def test_in_replicated_mode_each_rank_reports_only_the_matrices_it_owns(ranks2):
    (names0, owned0, updated), (names1, owned1, _) = ranks2.run(_replicated_stats)
    assert names0 == owned0 and names1 == owned1, "every matrix counted once over the ranks"
    assert len(names0) + len(names1) == updated and not set(names0) & set(names1)
