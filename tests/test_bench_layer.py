"""bench/layer.py --quick writes the JSON the issues name, with storage and memory ratios that match DESIGN
s3's byte counts (bf16 values + packed row codes or one motif byte per block), and its memory walker finds a tensor
a module caches in any attribute."""

import dataclasses
import json
import math

import torch

from bench import layer as bench_layer
from bench.memory import held_bytes

QUICK_SHAPES = ((32, 48), (48, 32), (64, 96))   # (in, out), as in bench/layer.py's QUICK_SHAPES


def expected_storage_ratio(n, layout):
    ratios = []
    for in_f, out_f in QUICK_SHAPES:
        k = in_f * n // 4
        code_bytes = out_f * math.ceil(k / 4) if layout == "row" else (out_f // 4) * (in_f // 4)
        ratios.append((out_f * k * 2 + code_bytes) / (out_f * in_f * 2))
    return max(ratios)


def test_quick_bench_layer_writes_every_named_figure(tmp_path, monkeypatch, capsys):
    # In-process: a subprocess would spend most of the test importing torch again.
    out = tmp_path / "bench_layer.json"
    threads = torch.get_num_threads()
    try:
        bench_layer.main(["--quick", "warmup=0", "repeats=1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    payload = json.loads(out.read_text())

    assert set(payload) == {"machine", "config", "fwd_bwd_ratio", "fwd_bwd_ratio_cpu", "nm_ops_over_linear_ops",
                            "nm_hard_perm_ops_over_linear_ops", "op_counts", "memory_ratio", "storage_ratio"}
    assert {"cpu", "cores", "torch", "deepspeed", "transformers", "gpu"} <= set(payload["machine"])
    assert payload["config"]["quick"] is True and payload["config"]["threads"] >= 1
    assert payload["config"]["target_fwd_bwd_ratio"] == 1.15
    cases = {f"{s}-{lay}/{i}x{o}" for s in ("1:4", "2:4") for lay in ("row", "block") for i, o in QUICK_SHAPES}
    assert set(payload["fwd_bwd_ratio"]) == cases
    assert all(math.isfinite(r) and r > 0 for r in payload["fwd_bwd_ratio"].values())
    assert all(math.isfinite(r) and r > 0 for r in payload["fwd_bwd_ratio_cpu"].values())
    for case, counts in payload["op_counts"].items():
        assert payload["nm_ops_over_linear_ops"][case] == counts["nm"] / counts["linear"] <= 3, case
        assert payload["nm_hard_perm_ops_over_linear_ops"][case] == counts["nm_hard_perm"] / counts["linear"] <= 3
        # nn.Linear without bias: at least its three GEMMs (forward, grad_x, grad_w).
        assert counts["linear"] >= 3 and counts["nm_hard_perm"] > counts["nm"] > counts["nm_views"] > 0, case
    assert set(payload["op_counts"]) == cases
    assert set(payload["storage_ratio"]) == {"1:4-row", "1:4-block", "2:4-row", "2:4-block"}
    assert set(payload["memory_ratio"]) == set(payload["storage_ratio"])
    for key, ratio in payload["storage_ratio"].items():
        n, layout = int(key[0]), key.split("-")[1]
        assert abs(ratio - expected_storage_ratio(n, layout)) < 1e-12, key
        assert abs(payload["memory_ratio"][key] - expected_storage_ratio(n, layout)) < 1e-12, key
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("storage_ratio")   # figures printed last


@dataclasses.dataclass
class CachedIndex:
    index: torch.Tensor
    key: tuple


def test_held_bytes_counts_parameters_buffers_and_tensors_cached_in_any_attribute():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    # Linear: weight 12 + bias 3 fp32; BatchNorm1d: weight, bias, running mean and var 3 each, int64 counter.
    base = 4 * (12 + 3) + 4 * 4 * 3 + 8
    assert held_bytes(net) == base
    net[0].weight.grad = torch.ones(3, 4)                  # gradients are not held by the layer between steps
    assert held_bytes(net) == base
    net[0].index = torch.zeros(10, dtype=torch.int32)       # a plain tensor attribute
    net[1].cache = [CachedIndex(torch.zeros(5, dtype=torch.int64), (0, 1)), {"w": torch.zeros(2, 2)}]
    net[1].alias = net[0].weight[:2]                        # a view of a held storage counts once
    assert held_bytes(net) == base + 4 * 10 + 8 * 5 + 4 * 4
