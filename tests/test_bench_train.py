"""bench/train.py: --quick (its ranks run on the suite's shared 2-rank pool) writes every figure issue 9 names
with the tiny model's FLOP count and the refresh amortization; the rank-combining and pairing arithmetic against
hand-computed medians."""

import json
import math
import statistics

import pytest

from bench import train as bench_train

ROWS = {"dense_adamw", "dense_muon", "dense_tans", "chtsnm_nobranch_1of4_row", "chts_muon_1of4_row",
        "chtsnm_nobranch_2of4_row"}
SPARSE = {"chtsnm_nobranch_1of4_row", "chts_muon_1of4_row", "chtsnm_nobranch_2of4_row"}
# The tiny model (configs/model/tiny.yaml) with the quick run's vocab 512, 2 ranks x 2 x 64 tokens.
LAYERS, HIDDEN, FFN, VOCAB, SEQ, TOKENS = 2, 64, 176, 512, 64, 2 * 2 * 64


@pytest.fixture
def bench():
    return bench_train



def test_quick_bench_train_writes_every_named_figure(bench, ranks2, tmp_path, capsys):
    out = tmp_path / "bench_train.json"
    bench.main(["--quick", "--json", str(out)], pool=ranks2)
    payload = json.loads(out.read_text())

    assert {"tokens_per_s", "chts_1of4_tans_over_dense_adamw", "over_dense_adamw", "phases_s",
            "dense_adamw_step_s_paired", "achieved_tflops", "mfu", "joules_per_token", "machine",
            "config"} <= set(payload)
    assert set(payload["tokens_per_s"]) == ROWS and set(payload["phases_s"]) == ROWS
    assert payload["chts_1of4_tans_over_dense_adamw"] == payload["over_dense_adamw"]["chtsnm_nobranch_1of4_row"]
    assert payload["over_dense_adamw"]["dense_adamw"] == 1.0
    assert payload["config"]["tokens_per_step"] == TOKENS and payload["config"]["quick"] is True
    # Dense-equivalent FLOPs: 6 x (7 projections per layer + LM head) x tokens + 12 L d T x tokens.
    matmul = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN) + VOCAB * HIDDEN
    assert payload["config"]["flops_per_step"] == 6 * matmul * TOKENS + 12 * LAYERS * HIDDEN * SEQ * TOKENS
    for row, ph in payload["phases_s"].items():
        assert all(math.isfinite(v) and v >= 0 for v in ph.values()), row
        assert ph["forward"] > 0 and ph["backward"] > 0 and ph["step"] > ph["forward"] + ph["backward"] - 1e-9
        # From the step's report: the boundary is its four phases. A row's median over its 2 timed steps is their
        # mean, linear in the phases; the reference's is over the 10 steps paired with every row.
        boundary = ph["reduce"] + ph["dense_step"] + ph["backbone_step"] + ph["gather"]
        assert ph["optimizer"] > 0
        if row != "dense_adamw":
            assert ph["optimizer"] == pytest.approx(boundary)
        parts = ph["data"] + ph["forward"] + ph["backward"] + ph["optimizer"]
        # Medians of 2 steps are means (linear: the parts add up within the step); the reference's medians over 10
        # steps are not, and the sum of medians may pass the median step by a little on a noisy machine.
        assert parts <= (ph["step"] + 1e-6) * (1.0 if row != "dense_adamw" else 1.25), (row, parts, ph["step"])
        if row in SPARSE:
            assert ph["refresh_step"] > 0 and ph["refresh"] == pytest.approx(ph["refresh_step"] / 100)
            assert payload["config"]["update_interval"][row] == 100
        else:
            assert ph["refresh"] == 0 and payload["config"]["update_interval"][row] is None
        assert payload["tokens_per_s"][row] == pytest.approx(TOKENS / (ph["step"] + ph["refresh"]))
        assert payload["achieved_tflops"][row] == pytest.approx(
            payload["config"]["flops_per_step"] / (ph["step"] + ph["refresh"]) / 1e12)
    # Counts of one steady step per row: the rank that dispatched most; the same model has the same forward+backward.
    for key in ("ops_per_step", "ops_per_fwd_bwd", "host_syncs_per_step"):
        assert set(payload[key]) == ROWS
        for row in ROWS:
            assert payload[key][row] == max(rank[row][key] for rank in payload["counts_by_rank"]), (key, row)
    for row in ROWS:
        assert payload["ops_per_step"][row] > payload["ops_per_fwd_bwd"][row] > 100
        assert payload["host_syncs_per_step"][row] <= 1, payload["counts_by_rank"][0][row]["sync_ops"]
    # Rows of one N:M pattern share a forward+backward (1:4 builds W by one multiply, 2:4 by a scatter).
    for pattern in {row.rsplit("_", 2)[-2] for row in SPARSE}:
        assert len({payload["ops_per_fwd_bwd"][row] for row in SPARSE if f"_{pattern}_" in row}) == 1, pattern
    assert len({payload["ops_per_fwd_bwd"][row] for row in ROWS - SPARSE}) == 1
    # A second code path: the bare model's forward + backward in this process, without DeepSpeed's engine and the
    # backbone's gradient hooks (which add ops, not remove them).
    for row in ("dense_adamw", "chtsnm_nobranch_1of4_row"):
        bare = _bare_fwd_bwd_ops(row)
        assert bare <= payload["ops_per_fwd_bwd"][row] <= 1.5 * bare, (row, bare, payload["ops_per_fwd_bwd"][row])
    if payload["machine"]["gpu"] is None:
        assert set(payload["mfu"].values()) == {None} and "skipped" in payload["joules_per_token"]
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("chts_1of4_tans_over_dense_adamw"), \
        "the figures table is last"


def _bare_fwd_bwd_ops(method: str) -> int:
    import torch
    from distsparse.config import load_config
    from distsparse.models import build_model
    from distsparse.models.causal_attention import use_causal_sdpa
    from distsparse.op_count import OpCounter
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={method}", "train.dtype=fp32"])
    model = build_model(cfg.model, cfg.method, VOCAB, 0)
    use_causal_sdpa(model)   # as the Trainer runs it
    x = torch.randint(0, VOCAB, (2, SEQ))
    with OpCounter() as counter:
        model(input_ids=x, labels=x).loss.backward()
    return counter.counts.ops


def _rec(step, forward=0.1, backward=0.2, partner="m", rnd=0, refresh=0.0, joules=None):
    return {"data": 0.001, "forward": forward, "backward": backward, "optimizer": step - forward - backward - refresh,
            "reduce": 0.0, "dense_step": 0.01, "backbone_step": 0.02, "gather": 0.0, "refresh": refresh,
            "step": step, "joules": joules, "partner": partner, "round": rnd}


def test_summary_keeps_the_slower_rank_and_pairs_each_round_with_its_reference_step(bench):
    # Rank 1 is slower in round 0 of the reference, rank 0 elsewhere; the sparse row "m" refreshes in 2.0 s
    # every 100 steps.
    rank0 = {"steps": {"dense_adamw": [_rec(1.0, rnd=0), _rec(1.2, rnd=1), _rec(0.9, rnd=2)],
                       "m": [_rec(2.0, rnd=0), _rec(1.5, rnd=1), _rec(3.0, rnd=2)]},
             "refresh": {"dense_adamw": None, "m": _rec(2.5, refresh=2.0)},
             "intervals": {"dense_adamw": None, "m": 100}}
    rank1 = {"steps": {"dense_adamw": [_rec(1.4, forward=0.3, rnd=0), _rec(1.1, rnd=1), _rec(0.8, rnd=2)],
                       "m": [_rec(1.9, rnd=0), _rec(1.4, rnd=1), _rec(2.9, rnd=2)]},
             "refresh": {"dense_adamw": None, "m": _rec(2.6, refresh=1.5)},
             "intervals": {"dense_adamw": None, "m": 100}}
    rows = bench.summarize([rank0, rank1], tokens_per_step=1000)

    ref, m = rows["dense_adamw"], rows["m"]
    assert ref["phases_s"]["step"] == pytest.approx(1.2)             # median of 1.4, 1.2, 0.9
    assert ref["phases_s"]["forward"] == pytest.approx(0.1)          # median of 0.3 (rank 1, round 0), 0.1, 0.1
    assert ref["tokens_per_s"] == pytest.approx(1000 / 1.2) and ref["over_dense_adamw"] == 1.0
    # The refresh of the slower rank of the refresh step (rank 1: 2.6 s step) is 1.5 s, amortized over 100.
    assert m["phases_s"]["refresh_step"] == pytest.approx(1.5) and m["phases_s"]["refresh"] == pytest.approx(0.015)
    assert m["tokens_per_s"] == pytest.approx(1000 / (2.0 + 0.015))
    # Per-round ratios t_ref / (t_m + refresh / 100): 1.4 / 2.015, 1.2 / 1.515, 0.9 / 3.015; their median.
    assert m["over_dense_adamw"] == pytest.approx(statistics.median([1.4 / 2.015, 1.2 / 1.515, 0.9 / 3.015]))
    assert m["reference_step_s"] == pytest.approx(1.2) and ref["reference_step_s"] == pytest.approx(1.2)
    assert m["joules_per_token"] is None


def test_joules_are_summed_over_ranks_and_divided_by_the_tokens_of_a_step(bench):
    def rank(joules):
        return {"steps": {"dense_adamw": [_rec(1.0, joules=joules)]}, "refresh": {"dense_adamw": None},
                "intervals": {"dense_adamw": None}}

    def run(j0, j1):
        return bench.summarize([rank(j0), rank(j1)], tokens_per_step=500)["dense_adamw"]["joules_per_token"]

    assert run(30.0, 20.0) == pytest.approx(50.0 / 500)
    assert run(30.0, None) is None


def test_counts_keep_the_rank_that_dispatched_most_per_row_and_key(bench):
    def rank(ops, fwd_bwd, syncs):
        return {"counts": {"m": {"ops_per_step": ops, "ops_per_fwd_bwd": fwd_bwd, "host_syncs_per_step": syncs}}}
    got = bench.combine_counts([rank(900, 600, 0), rank(1200, 500, 1)])
    assert got == {"m": {"ops_per_step": 1200, "ops_per_fwd_bwd": 600, "host_syncs_per_step": 1}}
