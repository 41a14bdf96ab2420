"""bench/checkpoint.py --quick (a subprocess: it starts its own rank) writes every figure the issue
names, and its byte counts match the layout arithmetic of the tiny model at 1:4 row-wise."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"backbone_ckpt_bytes_over_dense", "ckpt_bytes_over_dense", "save_seconds", "load_seconds", "machine",
        "config", "details"}

# The tiny model (configs/model/tiny.yaml): 2 layers of q, k, v, o [64, 64], gate, up [176, 64], down [64, 176].
LAYERS, HIDDEN, FFN = 2, 64, 176
DENSE = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN)   # dense backbone weights
KEPT = DENSE // 4                                            # 1:4: one value per group of 4
CODE_BYTES = KEPT * 2 // 8                                   # row-wise: a 2-bit position per kept value
FP32 = 4
HEADERS = 16 * 1024   # safetensors JSON header and per-matrix step counters


def test_quick_bench_checkpoint_writes_every_named_figure(tmp_path):
    out = tmp_path / "bench_checkpoint.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, "-m", "bench.checkpoint", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(out.read_text())

    assert set(payload) == KEYS
    assert {"cpu", "cores", "torch", "deepspeed", "transformers", "gpu"} <= set(payload["machine"])
    assert payload["config"]["quick"] is True and payload["config"]["vocab_size"] == 32000
    assert payload["config"]["module_dtype"] == "fp32"
    for key in ("save_seconds", "load_seconds"):
        assert math.isfinite(payload[key]) and payload[key] > 0, key
    sparse, dense = payload["details"]["runs"]["sparse"], payload["details"]["runs"]["dense"]
    # DeepSpeed's module copy of the backbone: fp32 values + codes against the fp32 dense weights.
    assert sparse["module_backbone_bytes"] == FP32 * KEPT + CODE_BYTES
    assert dense["module_backbone_bytes"] == FP32 * DENSE
    # Project files: master, V and P per kept value + codes; master, exp_avg and exp_avg_sq per dense weight.
    sparse_payload, dense_payload = 3 * FP32 * KEPT + CODE_BYTES, 3 * FP32 * DENSE
    assert sparse_payload <= sparse["backbone_file_bytes"] <= sparse_payload + HEADERS
    assert dense_payload <= dense["backbone_file_bytes"] <= dense_payload + HEADERS
    expected = (sparse_payload + FP32 * KEPT + CODE_BYTES) / (dense_payload + FP32 * DENSE)   # 0.258
    assert abs(payload["backbone_ckpt_bytes_over_dense"] - expected) < 0.01
    assert payload["backbone_ckpt_bytes_over_dense"] <= 0.30
    assert payload["ckpt_bytes_over_dense"] == sparse["total_bytes"] / dense["total_bytes"] < 1
    assert proc.stdout.rstrip().splitlines()[-1].startswith("load_seconds")   # the figures table last
