"""bench/scale_check.py --quick (model=tiny) (its ranks run on the suite's shared 2-rank pool): a 1:4 model built on the meta
device trains 3 steps with one refresh, and the bytes by part match the layout arithmetic of the tiny model; the
analytic accounting (the engine's own layout rules from the config's shapes) equals the measured 1:4 run and a
measured dense AdamW run part by part; at W = 64 sharded accumulation holds at most 1/32 of full mode's gradient
bytes per rank (issue 19)."""

import json

import pytest

from bench import scale_check

# The tiny model (configs/model/tiny.yaml): 2 layers of q, k, v, o [64, 64], gate, up [176, 64], down [64, 176].
LAYERS, HIDDEN, FFN, MATRICES = 2, 64, 176, 14
DENSE = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN)
KEPT = DENSE // 4                                     # 1:4
ALIGN = 128
VOCAB = 512                                           # the tiny run's vocab
DENSE_SIDE = 2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN   # untied embedding and head, RMSNorm weights


@pytest.fixture
def tool():
    return scale_check



def test_tiny_scale_check_trains_with_a_refresh_and_counts_bytes_by_part(tool, ranks2, tmp_path, capsys):
    out = tmp_path / "scale.json"
    tool.main(["--quick", "--json", str(out)], pool=ranks2)
    payload = json.loads(out.read_text())

    assert {"peak_rss_gb_per_rank", "backbone_state_bytes_over_dense_adamw", "model_state_bytes_per_rank",
            "dense_adamw_bytes_per_rank_analytic", "dense_adamw_bytes_per_rank_measured", "machine",
            "config"} <= set(payload)
    assert len(payload["peak_rss_gb_per_rank"]) == 2
    assert all(0 < over < peak for over, peak in zip(payload["peak_rss_over_idle_gb_per_rank"],
                                                     payload["peak_rss_gb_per_rank"]))
    for steps in payload["steps"].values():
        assert [s["refreshed"] for s in steps] == [False, True, False]

    sparse = payload["model_state_bytes_per_rank"]
    for rank in ("rank0", "rank1"):
        dense = sparse[rank]["dense_side"]
        assert dense["module_copy"] == 4 * DENSE_SIDE                 # fp32 module on every rank
        assert dense["fp32_partition"] == 4 * DENSE_SIDE // 2         # ZeRO: half the master each
        assert dense["moments"] == 2 * 4 * DENSE_SIDE // 2 + 4        # exp_avg, exp_avg_sq; fp32 scalar step
        # The gradient partition is a view of DeepSpeed's flat buffer, whose storage may be padded a little.
        assert 4 * DENSE_SIDE // 2 <= dense["grad_partition"] <= 4 * DENSE_SIDE // 2 + 4096
    backbone = [sparse[r]["backbone"] for r in ("rank0", "rank1")]
    for part in backbone:
        assert part["values"] == 4 * KEPT                  # fp32 values on every rank
        assert part["codes"] == KEPT // 4                  # 2-bit codes of 1 kept value per group of 4, packed
        assert part["index_cache"] == 0                    # no index cache: derived from the codes per call
    # Masters, V and P of each owned value, plus int64 tau and step counters per owned matrix, split over 2 ranks.
    assert sum(p["optimizer_state"] for p in backbone) == 12 * KEPT + 2 * 8 * MATRICES
    # Sharded accumulation (auto at W = 2, one micro-batch): each rank holds its own gradients only, in fp32, in
    # one bucket (the tiny backbone is far below the byte cap) padded to 128 values.
    assert payload["config"]["grad_accum_mode"] == "auto (ran as sharded)"
    assert all(p["grad_buffer"] % (4 * ALIGN) == 0 for p in backbone)
    assert 4 * KEPT <= sum(p["grad_buffer"] for p in backbone) < 4 * (KEPT + 2 * ALIGN)
    # Its staging: the one bucket (both ranks' segments, fp32), plus the reduced own segment while the reduce runs.
    transient = payload["backbone_grad_transient_peak_bytes_per_rank"]
    staging = sum(p["grad_buffer"] for p in backbone)
    assert transient == [staging + p["grad_buffer"] for p in backbone]
    modelled = payload["backbone_bytes_per_rank_analytic"]
    for rank, part in zip(("rank0", "rank1"), backbone):
        assert {k: v for k, v in modelled[rank].items() if k != "grad_transient_peak"} == part, rank
    assert [modelled[r]["grad_transient_peak"] for r in ("rank0", "rank1")] == transient

    analytic, measured = payload["dense_adamw_bytes_per_rank_analytic"], payload["dense_adamw_bytes_per_rank_measured"]
    assert analytic == measured
    assert all(analytic[r]["backbone"]["values"] == 4 * DENSE for r in analytic)
    assert all(analytic[r]["dense_side"] == sparse[r]["dense_side"] for r in analytic)

    ratio = max(sum(p.values()) for p in backbone) / max(sum(analytic[r]["backbone"].values()) for r in analytic)
    assert payload["backbone_state_bytes_over_dense_adamw"] == ratio

    # The analytic tables at W = 2 .. 512 (largest rank): full mode holds every gradient on every rank, sharded the
    # rank's own, so at W = 64 at most 1/32 (issue 19); dense AdamW in the same mode is the reference.
    for model in ("350m", "1b"):
        table = payload[f"analytic_largest_rank_{model}"]
        assert list(table) == [f"W={w} {m}" for w in (2, 8, 64, 512) for m in ("full", "sharded")]
        assert payload[f"grad_bytes_W64_sharded_over_full_{model}"] == table["W=64 sharded"]["grad_over_full_mode"]
        assert table["W=64 sharded"]["grad_over_full_mode"] <= 1 / 32
        for w in (8, 64, 512):
            full, sharded = table[f"W={w} full"], table[f"W={w} sharded"]
            assert sharded["grad_buffer"] * w <= full["grad_buffer"] * 1.05, (model, w)
            assert sharded["backbone_state_over_dense_adamw"] <= 0.27, (model, w)
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("grad_bytes_W64_sharded_over_full_1b"), \
        "the figures table last"


def test_index_cache_counts_every_tensor_a_layer_holds_besides_values_and_codes(tool):
    """A cache anywhere in a layer's attributes (a plain tensor, inside a dict, list or dataclass) is counted, once
    per storage; values, codes and gradients are not."""
    import torch

    from distsparse.layers import NMSparseLinear
    from distsparse.nm import NMSpec

    layer = NMSparseLinear(16, 8, NMSpec.parse("1:4", "row"))
    layer.values.grad = torch.ones_like(layer.values)
    assert tool.index_cache_bytes([layer], set()) == 0
    layer.index_cache = {"row": [torch.zeros(32, dtype=torch.int64)]}   # a nested cache
    layer.flat = torch.zeros(4, dtype=torch.int32)
    layer.alias = layer.flat[:2]
    assert tool.index_cache_bytes([layer], set()) == 8 * 32 + 4 * 4
    seen: set = set()
    assert tool.index_cache_bytes([layer, layer], seen) == 8 * 32 + 4 * 4 and seen
