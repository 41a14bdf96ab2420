"""bench/topology.py --quick writes the JSON issue 5 names; its refresh statistics match the zeta schedule
of the paper (research/cht_topology.md s2b) on the tiny model's shapes, and its ratios are built from its raw
seconds and bytes."""

import json
import math
import statistics

import torch

from bench import topology as bench

# The tiny preset (configs/model/tiny.yaml defaults): hidden 64, FFN 176, 2 layers; (out, in) per projection.
TINY_SHAPES = {"q_proj": (64, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 64),
               "gate_proj": (176, 64), "up_proj": (176, 64), "down_proj": (64, 176)}
TINY_LAYERS = 2


def expected_groups_selected(layout, step=100, total=10000, zeta0=0.1):
    t_end = int(0.75 * total)
    zeta = zeta0 / 2 * (1 + math.cos(math.pi * step / t_end))
    unit = 4 if layout == "row" else 16
    return TINY_LAYERS * sum(math.floor(zeta * (o * i // unit) + 0.5) for o, i in TINY_SHAPES.values()), zeta


def test_quick_bench_topology_writes_the_named_figures_from_its_raw_numbers(tmp_path, monkeypatch, capsys):
    # In-process: a subprocess would spend most of the test importing torch and transformers again.
    out = tmp_path / "bench_topology.json"
    threads = torch.get_num_threads()
    try:
        bench.main(["--quick", "warmup=0", "repeats=2", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    payload = json.loads(out.read_text())

    assert set(payload) == {"refresh_over_tans_step", "score_peak_bytes_over_dense_fp32", "machine", "config",
                            "seconds", "score_memory_bytes", "refresh_stats"}
    assert {"cpu", "cores", "torch", "deepspeed", "gpu"} <= set(payload["machine"])
    config = payload["config"]
    assert config["quick"] is True and config["threads"] == 1 and config["score_chunk_size"] == 512
    assert set(payload["refresh_over_tans_step"]) == {"row", "block"}
    for layout in ("row", "block"):
        assert config["layouts"][layout]["matrices"] == {f"{p}:{o}x{i}": TINY_LAYERS
                                                        for p, (o, i) in TINY_SHAPES.items()}
        rounds = payload["seconds"][layout]["rounds"]
        assert len(rounds["ratio"]) == 2
        for ratio, refresh, step in zip(rounds["ratio"], rounds["refresh"], rounds["tans_step"]):
            assert refresh > 0 and step > 0 and ratio == refresh / step
        assert payload["refresh_over_tans_step"][layout] == statistics.median(rounds["ratio"])
        stats = payload["refresh_stats"][layout]
        groups, zeta = expected_groups_selected(layout)
        assert stats["groups_selected"] == groups
        assert abs(stats["zeta"] - zeta) < 1e-12
        assert abs(stats["temperature"] - (1 + 8 * 100 / 7500)) < 1e-12
        assert 0 < stats["groups_changed"] <= groups

    memory = payload["score_memory_bytes"]
    assert memory["dense_fp32"] == 64 * 32 * 4
    assert memory["extra"] == [s - i for s, i in zip(memory["scores_peak_rss"], memory["idle_peak_rss"])]
    assert len(memory["extra"]) == config["memory_pairs"] == 1
    assert payload["score_peak_bytes_over_dense_fp32"] == memory["extra"][0] / memory["dense_fp32"]
    assert min(memory["idle_peak_rss"]) > 10 * 2 ** 20   # a real peak RSS of a process that imported torch
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("score_peak_bytes_over_dense_fp32")
