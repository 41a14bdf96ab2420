"""tools/scale_check.py --model tiny (its ranks run on the suite's shared 2-rank pool): a 1:4 model built on the meta
device trains 3 steps with one refresh, and the bytes by part match the layout arithmetic of the tiny model; the
analytic dense AdamW accounting equals a measured dense AdamW run part by part."""

import json

import pytest
from rankpool import import_tool, tool_runner

# The tiny model (configs/model/tiny.yaml): 2 layers of q, k, v, o [64, 64], gate, up [176, 64], down [64, 176].
LAYERS, HIDDEN, FFN, MATRICES = 2, 64, 176, 14
DENSE = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN)
KEPT = DENSE // 4                                     # 1:4
ALIGN = 128
VOCAB = 512                                           # the tiny run's vocab
DENSE_SIDE = 2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN   # untied embedding and head, RMSNorm weights


@pytest.fixture
def tool():
    return import_tool("scale_check")



def test_tiny_scale_check_trains_with_a_refresh_and_counts_bytes_by_part(tool, ranks2, tmp_path, capsys):
    runner = tool_runner(ranks2, "scale_check")
    out = tmp_path / "scale.json"
    tool.main(["--model", "tiny", "--json", str(out)], runner=runner)
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
    assert backbone[0]["grad_buffer"] == backbone[1]["grad_buffer"]
    assert backbone[0]["grad_buffer"] % (2 * 4 * ALIGN) == 0 and backbone[0]["grad_buffer"] >= 4 * KEPT

    analytic, measured = payload["dense_adamw_bytes_per_rank_analytic"], payload["dense_adamw_bytes_per_rank_measured"]
    assert analytic == measured
    assert all(analytic[r]["backbone"]["values"] == 4 * DENSE for r in analytic)
    assert all(analytic[r]["dense_side"] == sparse[r]["dense_side"] for r in analytic)

    ratio = max(sum(p.values()) for p in backbone) / max(sum(analytic[r]["backbone"].values()) for r in analytic)
    assert payload["backbone_state_bytes_over_dense_adamw"] == ratio
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("backbone/grad_buffer"), "table last"
