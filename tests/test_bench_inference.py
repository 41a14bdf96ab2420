"""bench/inference.py (issue 9 item 4): --quick writes every named key, R_CSR covers one decoder layer's
projections with their multiplicities and is the median of the per-round ratios, the 1:4 projection is
S_2:4 x R_CSR, and on CPU the GPU part is skipped with its reason. On a GPU, the padded 2:4 layer computes what the
dense layer computes."""

import json
import math
import statistics

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    from bench import inference
    return inference


def test_quick_bench_inference_writes_every_named_key(bench, tmp_path, capsys):
    out = tmp_path / "bench_inference.json"
    threads = torch.get_num_threads()
    bench.main(["--quick", "repeats=2", "gpu_iters=2", "--json", str(out)])
    assert torch.get_num_threads() == threads            # the CSR part's thread setting is restored
    payload = json.loads(out.read_text())

    assert {"machine", "config", "csr_ratio", "gpu"} <= set(payload)
    assert {"cpu", "cores", "torch", "gpu"} <= set(payload["machine"])
    assert set(payload["csr_ratio"]) == {"tiny", "small"}
    # tiny: hidden 64, FFN 176; small: hidden 256, FFN 688 (configs/model): q/k/v/o, gate/up, down.
    expected_shapes = {"tiny": {"64x64": 4, "176x64": 2, "64x176": 1},
                       "small": {"256x256": 4, "688x256": 2, "256x688": 1}}
    for size, ratio in payload["csr_ratio"].items():
        shapes = payload["csr"][size]["shapes"]
        assert {s: v["multiplicity"] for s, v in shapes.items()} == expected_shapes[size]
        rounds = payload["csr"][size]["round_ratios"]
        assert len(rounds) == 2 and ratio == pytest.approx(statistics.median(rounds), rel=1e-12)
        assert math.isfinite(ratio) and ratio > 0
        t14 = sum(v["multiplicity"] * v["t14_ms"] for v in shapes.values())
        assert payload["csr"][size]["layer_t14_ms"] == pytest.approx(t14, rel=1e-12)
        assert (size in payload["csr_flagged"]) == (not 1.3 <= ratio <= 2.3)
        assert payload["projected_1of4_speedup"][size]["speedup_1of4"] is None   # no paper value for these shapes
    if not torch.cuda.is_available():
        assert payload["gpu"] == {"skipped": "no CUDA device (torch.cuda.is_available() is False): 2:4 "
                                             "semi-structured kernels are CUDA-only"}
    else:
        assert set(payload["gpu"]["models"]) == {"tiny", "small"}
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("csr_ratio")   # figures printed last


def test_projection_multiplies_the_csr_ratio_by_the_measured_or_the_paper_2of4_speedup(bench):
    measured = bench.projection("350m", 1.8, {"models": {"350m": {"speedup_mean": 1.25}}})
    assert measured["source"] == "measured" and measured["speedup_1of4"] == pytest.approx(1.25 * 1.8)
    assumed = bench.projection("350m", 1.8, {"skipped": "no GPU"})
    assert assumed["source"].startswith("assumed") and assumed["speedup_2of4"] == pytest.approx((1.42 + 1.49) / 2)
    assert assumed["speedup_1of4"] == pytest.approx((1.42 + 1.49) / 2 * 1.8)


@pytest.mark.gpu
def test_padded_semi_structured_layer_matches_the_dense_layer(bench):
    from distsparse.nm import mask_from_scores
    _, tile = bench.select_backend("auto")
    gen = torch.Generator(device="cuda").manual_seed(0)
    out_f, in_f = tile[0] + 8, 2 * tile[1] + 8        # both dimensions need padding
    weight = torch.randn(out_f, in_f, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = weight * mask_from_scores(torch.rand(out_f, in_f, device="cuda", generator=gen), 2, "row")
    layer = bench.SemiStructuredLinear(weight, tile)
    assert (layer.pad_out, layer.pad_in) == (tile[0] - 8, tile[1] - 8)
    x = torch.randn(3, 40, in_f, device="cuda", generator=gen, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
    reference = x.double() @ weight.double().T
    assert y.shape == (3, 40, out_f)
    assert ((y.double() - reference).norm() / reference.norm()).item() < 1e-2
