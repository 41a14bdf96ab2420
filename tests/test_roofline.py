"""The H200 roofline (distsparse/perf/roofline.py) on hand-made traces against numbers worked out by hand, the tracer
(distsparse/perf/trace.py) on ops of known size, the simulated world against the engine's layout, and a smoke run
of bench/estimate_h200.py --quick (a subprocess) writing its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distsparse.perf.roofline import (
    BF16_PEAK_FLOPS, LAUNCH_FLOOR_S, collective_seconds, estimate, op_seconds, ring_factor,
)
from distsparse.perf.trace import CollectiveRecord, OpRecord, OpTracer, simulated_world

ROOT = Path(__file__).resolve().parents[1]

LAUNCH = OpRecord("aten.add.Tensor", flops=0.0, bytes=4_000)                   # 0.83 ns of HBM: the 5 us floor
FLOPS = OpRecord("aten.mm.default", flops=989e9, bytes=2_000_000)              # 1 ms at 989 TFLOP/s
FP32 = OpRecord("aten.mm.default", flops=67e9, bytes=2_000_000, fp32_matmul=True)   # 1 ms at 67 TFLOP/s
BYTES = OpRecord("aten.mul.Tensor", flops=0.0, bytes=9_600_000_000)           # 2 ms at 4.8 TB/s
VIEW = OpRecord("aten.view.default", flops=0.0, bytes=0, view=True)


def test_an_op_costs_the_largest_of_its_launch_floor_flops_and_bytes():
    assert op_seconds(LAUNCH) == 5e-6
    assert op_seconds(FLOPS) == pytest.approx(1e-3, rel=1e-12)
    assert op_seconds(FP32) == pytest.approx(1e-3, rel=1e-12)
    assert op_seconds(BYTES) == pytest.approx(2e-3, rel=1e-12)
    assert op_seconds(VIEW) == 0.0
    # the same FLOPs in bf16 are 989/67 times faster than on the fp32 cores
    assert op_seconds(OpRecord("mm", 67e9, 0)) == pytest.approx(67e9 / 989e12, rel=1e-12)


def test_collectives_at_ring_cost_over_nvlink_inside_a_node_and_400_gbps_across():
    # 450 MB all-reduce on 8 GPUs: 2 * 7/8 * 450e6 B / 450e9 B/s = 1.75 ms
    assert collective_seconds(CollectiveRecord("all_reduce", 450_000_000), 8) == pytest.approx(1.75e-3, rel=1e-12)
    # reduce-scatter of the same buffer: each rank sends 7 of 8 shards, 0.875 ms
    assert collective_seconds(CollectiveRecord("reduce_scatter", 450_000_000), 8) == pytest.approx(0.875e-3,
                                                                                                    rel=1e-12)
    # 16 GPUs leave the node: 15/16 * 50e6 B / 50e9 B/s = 0.9375 ms
    assert collective_seconds(CollectiveRecord("all_gather", 50_000_000), 16) == pytest.approx(0.9375e-3, rel=1e-12)
    assert collective_seconds(CollectiveRecord("broadcast", 10), 2) == LAUNCH_FLOOR_S
    assert collective_seconds(CollectiveRecord("all_reduce", 450_000_000), 1) == 0.0
    with pytest.raises(ValueError, match="'alltoall'.*all_reduce, reduce_scatter, all_gather, broadcast"):
        ring_factor("alltoall", 8)


def test_estimate_sums_the_ops_by_what_bounds_them_plus_the_collectives():
    est = estimate([LAUNCH, FLOPS, FP32, BYTES, VIEW], [CollectiveRecord("all_reduce", 450_000_000)], 8)
    assert est["launch_bound_s"] == pytest.approx(5e-6)
    assert est["flop_bound_s"] == pytest.approx(2e-3)
    assert est["byte_bound_s"] == pytest.approx(2e-3)
    assert est["collective_s"] == pytest.approx(1.75e-3)
    assert est["total_s"] == pytest.approx(5e-6 + 2e-3 + 2e-3 + 1.75e-3)
    assert est["launches"] == 4   # the view launches nothing
    assert est["flops"] == 989e9 + 67e9


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tracer_counts_a_matmul_as_2mnk_flops_and_its_operands_bytes(device):
    m, k, n = 12, 40, 24
    a, b = torch.ones(m, k, device=device), torch.ones(k, n, device=device)
    with OpTracer() as tracer:
        torch.mm(a, b)
    (rec,) = tracer.records
    assert rec.name == "aten.mm.default" and rec.flops == 2 * m * n * k
    assert rec.bytes == 4 * (m * k + k * n + m * n) and rec.fp32_matmul
    assert tracer.counts.ops == 1   # OpCounter's counts kept
    with OpTracer() as tracer:
        torch.mm(a.bfloat16(), b.bfloat16())
    assert not tracer.records[-1].fp32_matmul and tracer.records[-1].bytes == 2 * (m * k + k * n + m * n)


def test_tracer_counts_an_add_as_bytes_read_and_written_and_a_view_as_nothing():
    x, y = torch.ones(3, 5), torch.ones(5, dtype=torch.float64)
    with OpTracer() as tracer:
        z = x + y                       # reads 15 fp32 and 5 fp64, writes 15 fp64 (promoted)
        x.add_(x)                       # reads x twice, writes x
        z.view(-1)
        torch._foreach_add_([x, x], 1.0)   # returns nothing: its two mutated arguments are the writes
    add, add_, view, foreach = tracer.records
    assert (add.flops, add.bytes) == (0.0, 15 * 4 + 5 * 8 + 15 * 8)
    assert add_.bytes == 3 * 15 * 4
    assert view.view and view.bytes == 0
    assert foreach.bytes == 2 * 2 * 15 * 4


def test_simulated_world_records_collectives_and_lays_the_engine_out_for_every_rank():
    from distsparse.config import load_config
    from distsparse.models import backbone_modules
    from distsparse.perf.step_trace import build_engine, meta_model

    log = []
    with simulated_world(4, 3, log):
        assert torch.distributed.get_world_size() == 4 and torch.distributed.get_rank() == 3
        torch.distributed.all_reduce(torch.ones(10))
    assert log == [CollectiveRecord("all_reduce", 40)]
    cfg = load_config(None, ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row"])
    owned = []
    for rank in range(2):
        log = []
        with simulated_world(2, rank, log):
            engine = build_engine(cfg, backbone_modules(meta_model(cfg, 512)))
            engine.step(1e-3)
        owned.append({m.name for m in engine.owned()})
        # one value gather of every rank's shard, bf16 values
        assert log == [CollectiveRecord("all_gather", 2 * engine.shard_size * 2)]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert owned[0] | owned[1] == set(engine.matrices)
    with pytest.raises(ValueError, match="rank: got 2 with world_size 2"):
        with simulated_world(2, 2, []):
            pass


def test_estimate_h200_quick_writes_the_figures_it_prints(tmp_path):
    out = tmp_path / "est.json"
    proc = subprocess.run([sys.executable, "-m", "bench.estimate_h200", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    ratio, share = data["est_h200_chts_1of4_tans_over_dense_adamw"], data["est_h200_tans_share"]
    assert set(ratio["tiny"]) == set(share["tiny"]) == {"1", "2"}
    for w, r in data["results"]["tiny"]["by_world_size"].items():
        dense = sum(p["total_s"] for p in r["rows"]["dense_adamw"]["phases"].values())
        rank = r["rows"]["chtsnm_nobranch_1of4_row"]["ranks"][r["rows"]["chtsnm_nobranch_1of4_row"]["slowest_rank"]]
        chts = sum(p["total_s"] for p in rank["phases"].values()) + rank["refresh_amortized_s"]
        assert ratio["tiny"][w] == pytest.approx(dense / chts, rel=1e-12)
        assert share["tiny"][w] == pytest.approx(rank["backbone_s"] / chts, rel=1e-12)
        assert 0 < share["tiny"][w] < 1
        # the dense row's forward+backward launches at least one kernel per parameter's gradient
        assert r["rows"]["dense_adamw"]["phases"]["forward_backward"]["launches"] > 0
        assert r["rows"]["dense_adamw"]["phases"]["forward_backward"]["flops"] > 0
    assert data["model"]["bf16_peak_flops"] == BF16_PEAK_FLOPS
    assert f"{ratio['tiny']['2']:.3f}" in proc.stdout   # the table shows the figure written


def test_estimate_h200_refuses_bad_arguments_naming_them():
    for argv, words in ((["world_sizes=0"], "world_sizes: got '0'"), (["models=7b"], "models: got '7b'")):
        proc = subprocess.run([sys.executable, "-m", "bench.estimate_h200", *argv], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and words in proc.stderr and "allowed" in proc.stderr


# ---- the traced pieces against the real Trainer ----------------------------------------------------------------

TRAINER_OVERRIDES = ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row", "data.seq_len=32",
                     "train.dtype=fp32", "train.micro_batch=2", "train.grad_accum=2", "train.grad_clip=0",
                     "train.log_interval=1000", "train.warmup_steps=0", "train.steps=1000"]


def _matmul_flops(ops) -> float:
    """FLOPs of the GEMMs (attention apart: on the CPU SDPA's flash kernel is one flop_counter does not know)."""
    return sum(op.flops for op in ops if "scaled_dot_product" not in op.name)


def _trainer_vs_pieces(rank, world_size, data_dir, out_dir):
    from collections import Counter

    from distsparse.config import load_config
    from distsparse.data import collate
    from distsparse.perf.step_trace import rank_traces
    from distsparse.train.deepspeed.config import build_ds_config
    from distsparse.train.trainer import Trainer

    cfg = load_config(None, TRAINER_OVERRIDES + [f"data.dir={data_dir}", f"train.out_dir={out_dir}/{rank}"])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    trainer.topology.due = lambda step: False
    batches = iter(trainer.sampler)

    def step():
        trainer.train_step([collate(trainer.train_data, next(batches)) for _ in range(cfg.train.grad_accum)])
        trainer.step += 1
    for _ in range(12):   # past TANS's ramp (8 steps): Newton-Schulz runs on every matrix
        step()
    with OpTracer() as tracer:
        step()
    trainer.close()
    pieces = rank_traces(cfg, cfg.model.vocab_size or 97, world_size, rank, sparse=True)
    c10d = Counter(op.name.split(".")[1] for op in tracer.records if op.name.startswith("c10d."))
    return {"trainer_flops": _matmul_flops(tracer.records),
            "pieces_flops": _matmul_flops(pieces["forward_backward"].ops + pieces["backbone_step"].ops),
            "backbone_flops": _matmul_flops(pieces["backbone_step"].ops),
            "flash_ops": [op.name for op in pieces["forward_backward"].ops if "scaled_dot_product" in op.name],
            "trainer_c10d": dict(c10d),
            "pieces_collectives": dict(Counter(c.kind for k in ("forward_backward", "backbone_step", "joint_scalars",
                                                                 "dense_step") for c in pieces[k].collectives))}


def test_the_traced_pieces_hold_the_flops_and_collectives_of_a_real_trainer_step_on_two_ranks(ranks2, tmp_path):
    """The meta-device pieces (model forward+backward, the engine's steady step, the joint scalars and the ZeRO-2
    replay, rank r of 2 simulated) count the GEMM FLOPs and issue the collectives that the real Trainer.train_step on
    2 gloo ranks dispatches (c10d ops in its dispatch trace; DeepSpeed's dense side adds no GEMMs)."""
    from synthetic_data import make_data_dir

    data = make_data_dir(tmp_path / "data")
    out = ranks2.run(_trainer_vs_pieces, data, str(tmp_path / "runs"))
    layers, micro_batches = 2, 2   # the tiny model, train.grad_accum
    for r in out:
        assert r["backbone_flops"] > 0   # Newton-Schulz is in the engine's step
        # attention as on a GPU: one flash kernel forward and one backward per layer and micro-batch
        assert sorted(set(r["flash_ops"])) == ["aten._scaled_dot_product_flash_attention.default",
                                               "aten._scaled_dot_product_flash_attention_backward.default"]
        assert len(r["flash_ops"]) == 2 * layers * micro_batches
        assert r["pieces_flops"] == pytest.approx(r["trainer_flops"], rel=1e-9), r
        # the same collectives, kind by kind: engine buckets, value gather, DeepSpeed's all-reduce per micro-batch
        # and parameter gather, the joint step's scalars
        c10d = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter", "_allgather_base_": "all_gather"}
        assert {c10d[k]: n for k, n in r["trainer_c10d"].items()} == r["pieces_collectives"]
