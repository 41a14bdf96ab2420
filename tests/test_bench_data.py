"""bench/data.py --quick writes every figure issue 30 names; its runs prepare the same text 1x, 8x and as 8
parts (so their token counts are 1, 8 and 8 times one copy's), and its extrapolation follows from its own rates."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {"peak_rss_8x_over_1x", "pipeline_over_encode_only", "workers_2_over_1"}


def test_quick_bench_data_writes_the_named_figures_and_consistent_runs(tmp_path):
    rng = random.Random(0)
    words = "data shard worker token budget corpus part stream memory rate".split()
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))
                                for _ in range(400)))
    out = tmp_path / "bench_data.json"
    proc = subprocess.run([sys.executable, "-m", "bench.data", "--quick", f"text={text}", "vocab_size=300",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(out.read_text())
    assert FIGURES <= set(payload) and {"machine", "config", "extrapolation", "runs"} <= set(payload)
    for key in FIGURES:
        assert math.isfinite(payload[key]) and payload[key] > 0, key
    runs = payload["runs"]
    once = runs["text 1x, 1 part"]["tokens"]
    assert runs["text 8x, 1 part"]["tokens"] == 8 * once
    assert runs["8 parts, 1 worker(s) #0"]["tokens"] == runs["8 parts, 2 worker(s) #0"]["tokens"] == 8 * once
    assert payload["peak_rss_8x_over_1x"] == (runs["text 8x, 1 part"]["peak_rss_mb"]["worker_max"]
                                              / runs["text 1x, 1 part"]["peak_rss_mb"]["worker_max"])
    one = runs["8 parts, 1 worker(s) #0"]
    rate = one["tokens"] / (one["seconds"]["parts"] + one["seconds"]["finalize"])
    for cores in (16, 64):
        row = payload["extrapolation"]["per_core"][f"{cores}_cores"]
        expected = (20e9 / (rate * cores * payload["workers_2_over_1"] / 2)
                    + 20e9 * one["seconds"]["finalize"] / one["tokens"]) / 3600
        assert row["hours"] == pytest.approx(expected, rel=1e-9)
    assert "figure" in proc.stdout and "workers_2_over_1" in proc.stdout   # the table is printed last
