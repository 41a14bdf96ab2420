"""bench/optimizer.py --quick (a subprocess: it starts its own 2 gloo ranks) writes every figure issue 4
names; its byte, state and balance figures equal a count made here from the tiny model's shapes with the layout
arithmetic of DESIGN decision 2 (LPT owners on NS FLOPs, 128-aligned shards, ring collectives)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"opt_step_s", "tans_sharded_over_deepspeed_muon", "tans_sharded_over_replicated",
        "ns_flops_max_over_mean_rank", "backbone_comm_bytes_over_dense_allreduce_bf16",
        "backbone_comm_bytes_over_dense_allreduce_fp32", "backbone_state_bytes_per_rank", "machine", "config",
        "ops_per_step", "syncs_per_step", "tans_ops_per_step", "tans_batched_over_per_matrix_max_rel_err", "op_counts"}
VARIANTS = {"dense_adamw", "deepspeed_muon", "sparse_muon", "tans_replicated", "tans_sharded", "sparse_dense_side",
            "tans_sharded_backbone", "tans_replicated_backbone"}

# The tiny model (configs/model/tiny.yaml) at 1:4 row-wise: 2 layers of q, k, v, o [64, 64], gate, up [176, 64] and
# down [64, 176] as (out, in).
LAYERS, HIDDEN, FFN = 2, 64, 176
SHAPES = [(f"layer{i}.{p}", out, inp) for i in range(LAYERS)
          for p, out, inp in [("q", HIDDEN, HIDDEN), ("k", HIDDEN, HIDDEN), ("v", HIDDEN, HIDDEN), ("o", HIDDEN, HIDDEN),
                              ("gate", FFN, HIDDEN), ("up", FFN, HIDDEN), ("down", HIDDEN, FFN)]]
W, ALIGN, UPDATE_INTERVAL = 2, 128, 100


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def values(out: int, inp: int) -> int:
    return out * inp // 4                    # one kept value per group of 4 inputs


def code_bytes(out: int, inp: int) -> int:
    return out * -(-(inp // 4) // 4)        # 2 bits per kept value, rows padded to whole bytes


def cost(out: int, inp: int) -> float:
    s, l = min(out, inp), max(out, inp)
    return 5 * (4 * s * s * l + 2 * s ** 3) + 50 * values(out, inp)   # NS FLOPs (K = 5) + element-wise work


def owners(world_size: int) -> dict[str, int]:
    """Greedy LPT, heaviest first, ties by name; each matrix to the least-loaded rank (ties by rank id)."""
    load, out = [0.0] * world_size, {}
    for name, o, i in sorted(SHAPES, key=lambda s: (-cost(s[1], s[2]), s[0])):
        r = min(range(world_size), key=lambda j: (load[j], j))
        out[name], load[r] = r, load[r] + cost(o, i)
    return out


def per_rank(world_size: int, size) -> list[int]:
    own = owners(world_size)
    return [sum(size(o, i) for name, o, i in SHAPES if own[name] == r) for r in range(world_size)]


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_optimizer.json"
    proc = subprocess.run([sys.executable, "-m", "bench.optimizer", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("backbone_comm_bytes_over_dense_allreduce_fp32"), \
        "the figures table is printed last"
    return json.loads(out.read_text())


def test_quick_bench_writes_every_named_figure_with_positive_times(payload):
    assert set(payload) == KEYS
    assert set(payload["opt_step_s"]) == VARIANTS
    assert all(math.isfinite(t) and t > 0 for t in payload["opt_step_s"].values())
    for key in ("tans_sharded_over_deepspeed_muon", "tans_sharded_over_replicated"):
        assert math.isfinite(payload[key]) and payload[key] > 0, key
    assert payload["config"]["quick"] is True and payload["config"]["model"] == "tiny"
    assert {"cpu", "cores", "torch", "deepspeed", "transformers", "gpu"} <= set(payload["machine"])


def test_byte_ratios_equal_the_ring_count_of_the_padded_shards(payload):
    dense = sum(o * i for _, o, i in SHAPES)
    shard = aligned(max(per_rank(W, values)))
    codes_shard = aligned(max(per_rank(W, code_bytes)))
    sent = ((W - 1) * shard * 4                                 # fp32 gradient reduce-scatter
            + (W - 1) * shard * 2                               # bf16 value all-gather
            + (W - 1) * codes_shard / UPDATE_INTERVAL           # uint8 codes after a refresh, amortized
            + 2 * (W - 1) / W * 4 * 8)                          # the joint step's 4 float64 scalars, one all-reduce
    ring = 2 * (W - 1) / W * dense
    assert payload["backbone_comm_bytes_over_dense_allreduce_bf16"] == pytest.approx(sent / (ring * 2), rel=1e-12)
    assert payload["backbone_comm_bytes_over_dense_allreduce_fp32"] == pytest.approx(sent / (ring * 4), rel=1e-12)


def test_state_bytes_and_balance_equal_the_count_from_the_owner_map(payload):
    state = payload["backbone_state_bytes_per_rank"]
    own = owners(W)
    matrices = [sum(1 for r in own.values() if r == rank) for rank in range(W)]
    # fp32 master, V and P per value; int64 tau and step per matrix; full mode's fp32 gradient buffer [W * S] on
    # each rank.
    total = sum(values(o, i) for _, o, i in SHAPES)
    expected_w2 = max(12 * v + 16 * m for v, m in zip(per_rank(W, values), matrices))
    assert state["W=1"] == 12 * total + 16 * len(SHAPES)
    assert state["W=2"] == expected_w2
    assert state["W=2_over_W=1"] == pytest.approx(expected_w2 / state["W=1"], rel=1e-12)
    assert state["grad_buffer_W=1"] == 4 * aligned(total)
    assert state["grad_buffer_W=2"] == 4 * W * aligned(max(per_rank(W, values)))
    assert state["with_grad_buffer_W=2"] == expected_w2 + state["grad_buffer_W=2"]
    # Sharded accumulation: each rank's own gradients only (one bucket: the tiny backbone is under the byte cap).
    assert state["grad_accumulator_W=2"] == 4 * max(aligned(v) for v in per_rank(W, values))
    assert state["with_grad_accumulator_W=2_over_W=1"] == pytest.approx(
        (expected_w2 + state["grad_accumulator_W=2"]) / (state["W=1"] + state["grad_buffer_W=1"]), rel=1e-12)
    # The groups' kept-index cache: int32 per value of the matrices a rank updates.
    assert state["derived_cache_W=1"] == 4 * total
    assert state["derived_cache_W=2"] == 4 * max(per_rank(W, values))
    loads = per_rank(W, cost)
    assert payload["ns_flops_max_over_mean_rank"] == pytest.approx(max(loads) / (sum(loads) / W), rel=1e-12)


def test_every_row_has_its_op_and_sync_counts_and_the_tans_count_follows_the_groups(payload):
    assert set(payload["ops_per_step"]) == set(payload["syncs_per_step"]) == VARIANTS
    assert all(n > 0 for n in payload["ops_per_step"].values())
    assert payload["syncs_per_step"]["tans_sharded_backbone"] == 0, "the engine alone syncs nothing"
    counts = payload["op_counts"]
    assert counts["one_rank"]["matrices"] == len(SHAPES) and counts["one_rank"]["groups"] == 3
    assert counts["one_rank_half_layers"]["matrices"] == len(SHAPES) // 2
    # Twice the matrices, the same groups: the same ops; so at reduced widths and on the meta device.
    assert payload["tans_ops_per_step"] == counts["one_rank"]["ops"] == counts["one_rank_half_layers"]["ops"] \
        == counts["one_rank_reduced_widths"]["ops"]
    assert payload["tans_ops_per_step"] <= 1800 and counts["one_rank"]["syncs"] == 0
    two = counts["two_ranks_reduced_widths"]
    assert [c["matrices"] for c in two] == [sum(1 for r in owners(W).values() if r == rank) for rank in range(W)]
    assert 0 <= payload["tans_batched_over_per_matrix_max_rel_err"] <= 1e-5
