"""Scale check (issue 9 item 5, issue 19 item 3; DESIGN decision 16): a 1:4 CHTsNM model built on the meta device
trains 3 steps (one refresh) on 2 CPU ranks; peak memory and model-state bytes per rank by part, beside the same
accounting for dense AdamW under ZeRO-2 (analytic, and measured at tiny); then the engine's own layout rules give
the backbone's bytes per rank at W = 2 .. 512 for 350m and 1b in both accumulation modes. What each part holds and
when it is read: docs/benchmarks.md. Run by hand, not in CI (a 1B step takes minutes on 2 cores):

    python -m bench.scale_check model=1b --json out.json      # or 350m
    python -m bench.scale_check --quick --json out.json        # model=tiny: the test suite's run
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.core import Figure, Settings, finish, parse, progress
from bench.memory import held_tensors, peak_rss_bytes, reset_peak, rss_bytes, storage_bytes
from bench.ranks import RankPool, on_ranks
from bench.synthetic import write_synthetic_data
from bench.trainers import build_trainer
from distsparse.memory_estimate import (BACKBONE_PARTS, DENSE_PARTS, backbone_analytic, classic_zero2_bytes,
                                        dense_matrices, method_config, preset_matrices, rank_total, scale_table,
                                        state_parts)

MODELS = ("tiny", "350m", "1b")
ANALYTIC_MODELS = ("350m", "1b")
WORLD_SIZES = (2, 8, 64, 512)      # analytic: the measured W and beyond
ACCUM_MODES = ("full", "sharded")
METHOD = "chtsnm_nobranch_1of4_row"
DENSE_METHOD = "dense_adamw"
STEPS, UPDATE_INTERVAL, SEQ_LEN, MICRO_BATCH = 3, 2, 256, 1
# What a user fitting 1b on two ranks of 24 GiB sets (DeepSpeed's default 5e8-element buckets are sized for GPUs).
# Full mode pads every rank's shard of a bucket to the largest, so one bucket holds the fewest bytes (at W = 64
# eight buckets would hold 4x more); the measured and the analytic full mode both use it.
FULL_NUM_BUCKETS = 1
MEMORY_OVERRIDES = ("model.activation_checkpointing=true", f"engine.num_buckets={FULL_NUM_BUCKETS}")
DS_BUCKET_ELEMENTS = 50_000_000
# glibc raises its mmap threshold (up to 32 MiB) after each large free, so the many 10-45 MiB per-matrix
# temporaries of a refresh land in the heap and stay resident after being freed; a fixed 1 MiB threshold returns
# every large tensor to the system when it dies (mallopt(3), M_MMAP_THRESHOLD). The command line sets it for the
# ranks it starts.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
TARGET = 0.26                      # issue 19: backbone_state_bytes_over_dense_adamw <= 0.26
GRAD_TARGET_W, GRAD_TARGET = 64, 1 / 32   # issue 19: gradient bytes per rank at W = 64, sharded / full
GIB = 2**30


@dataclass
class ScaleSettings(Settings):
    model: str = "1b"                  # tiny, 350m or 1b
    measure_dense: bool = False        # also train dense_adamw for real (implied by model=tiny)
    grad_accum_mode: str = "auto"      # engine.grad_accum_mode of the measured runs (auto: sharded at W = 2)
    QUICK = {"model": "tiny"}

    def __post_init__(self) -> None:
        self.one_of(model=MODELS, grad_accum_mode=("auto", *ACCUM_MODES))
        self.measure_dense = self.measure_dense or self.model == "tiny"

    @property
    def vocab(self) -> int:
        return 512 if self.model == "tiny" else 32000


# ---- bytes --------------------------------------------------------------------------------------------------------

def dense_side_bytes(trainer, seen: set) -> dict[str, int]:
    """DeepSpeed ZeRO-2's model state on this rank (call after backward, before engine.step)."""
    return trainer.joint.dense.state_bytes(seen)


def index_cache_bytes(layers: Iterable[torch.nn.Module], seen: set) -> int:
    """Bytes of every tensor the layers hold besides their parameters and buffers (values, codes): any attribute,
    also inside lists, dicts and dataclasses (memory.held_tensors), so a cache cannot hide in a container."""
    tensors = []
    for layer in layers:
        own = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers())}
        tensors += [t for t in held_tensors(layer) if t.untyped_storage().data_ptr() not in own]
    return storage_bytes(tensors, seen)


def backbone_bytes(trainer, seen: set) -> dict[str, int]:
    from distsparse.layers import NMSparseLinear
    from distsparse.models import backbone_param

    modules = trainer.backbone.values()
    sparse = [m for m in modules if isinstance(m, NMSparseLinear)]
    matrix = trainer.matrix
    grads = matrix.grads.persistent()
    return {"values": storage_bytes((backbone_param(m) for m in modules), seen),
            "codes": storage_bytes((m.codes for m in sparse), seen),
            "index_cache": index_cache_bytes(sparse, seen),
            "optimizer_state": matrix.state_bytes() - storage_bytes(grads),
            "origin_codes": matrix.origin_code_bytes(),
            "grad_buffer": storage_bytes(grads, seen)}


def model_state_bytes(trainer) -> dict[str, dict[str, int]]:
    """Both sides' bytes by part, each storage counted once."""
    seen: set = set()
    return {"dense_side": dense_side_bytes(trainer, seen), "backbone": backbone_bytes(trainer, seen)}


# ---- per rank ----------------------------------------------------------------------------------------------------

def _train_and_count(rank: int, s: ScaleSettings, method: str, data_dir: str, out_dir: str) -> dict:
    """Build `method` on the meta device, train STEPS steps, return its bytes by part, step log and shapes."""
    from distsparse.models import parameter_counts

    log = progress(f"bench.scale_check: {method}", rank)
    overrides = [f"model.preset={s.model}", f"method.preset={method}", "model.meta_device_init=true",
                 f"model.vocab_size={s.vocab}", f"data.dir={data_dir}", f"data.seq_len={SEQ_LEN}",
                 f"train.micro_batch={MICRO_BATCH}", "train.grad_accum=1", f"train.steps={STEPS}",
                 f"train.out_dir={Path(out_dir) / method}", f"engine.grad_accum_mode={s.grad_accum_mode}",
                 *MEMORY_OVERRIDES]
    if method != DENSE_METHOD:
        overrides.append(f"method.topology.update_interval={UPDATE_INTERVAL}")
    log("building on the meta device")
    trainer = build_trainer(overrides, bucket_elements=DS_BUCKET_ELEMENTS)
    counts = parameter_counts(trainer.model)
    built_rss_gb = peak_rss_bytes() / GIB
    log(f"built ({built_rss_gb:.2f} GiB peak RSS so far): {counts}")
    parts: dict[str, dict[str, int]] = {}
    steps = []
    for i in range(STEPS):
        t0 = time.perf_counter()
        # The last step's bytes are read right after its backward: gradients held, before either side's update.
        with trainer.timer.at_mark("backward", lambda: parts.update(model_state_bytes(trainer))):
            metrics = trainer.step_once(timed=i == STEPS - 1).metrics
        steps.append({"seconds": time.perf_counter() - t0, "loss": metrics["loss/train"],
                      "refreshed": "topology/refresh_s" in metrics, "peak_rss_gb_so_far": peak_rss_bytes() / GIB})
        log(f"step {trainer.step}/{STEPS}: {steps[-1]['seconds']:.1f}s, loss {steps[-1]['loss']:.4f}, "
            f"refresh {steps[-1]['refreshed']}, peak RSS so far {steps[-1]['peak_rss_gb_so_far']:.2f} GiB")
    grads = trainer.matrix.grad_bytes()
    trainer.close()
    shapes = {name: (m.out_features, m.in_features) for name, m in trainer.backbone.items()}
    return {"parts": parts, "steps": steps, "shapes": shapes, "counts": counts, "built_peak_rss_gb": built_rss_gb,
            "grad_accum_mode": trainer.matrix.grad_accum_mode, "grad_transient_peak": grads["transient_peak"]}


def _rank_main(rank: int, world_size: int, s: ScaleSettings, methods: list[str], data_dir: str,
               out_dir: str) -> list[dict]:
    """Each method in turn; peak RSS is that of the first (later ones share the process, so only its peak is
    that method's own)."""
    import deepspeed  # noqa: F401  (part of the idle baseline)
    import distsparse.train.trainer  # noqa: F401

    gc.collect()
    reset_peak()
    idle_gb = rss_bytes() / GIB
    results = []
    for i, method in enumerate(methods):
        result = _train_and_count(rank, s, method, data_dir, out_dir)
        if i == 0:
            result.update(peak_rss_gb=peak_rss_bytes() / GIB, idle_rss_gb=idle_gb)
        results.append(result)
        gc.collect()
    return results


# ---- driver ------------------------------------------------------------------------------------------------------

def run(s: ScaleSettings, methods: list[str], world_size: int, pool: RankPool | None) -> list[list[dict]]:
    """[method][rank] results of one run on `world_size` ranks (`pool`'s, or fresh ones)."""
    with tempfile.TemporaryDirectory(prefix="scale_check_") as tmp:
        data_dir = write_synthetic_data(Path(tmp) / "data", s.vocab, 64 * SEQ_LEN)
        per_rank = on_ranks(pool, world_size, _rank_main, s, methods, data_dir, str(Path(tmp) / "run"))
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(methods))]


def main(argv: list[str] | None = None, pool: RankPool | None = None) -> dict[str, Any]:
    s, json_path = parse(ScaleSettings, argv, __doc__.split("\n\n")[0])
    world_size = 2
    # The dense run, when measured, follows in the same processes: only the sparse run's peak RSS is its own.
    methods = [METHOD, DENSE_METHOD] if s.measure_dense else [METHOD]
    runs = run(s, methods, world_size, pool)
    sparse, measured = runs[0], (runs[1] if s.measure_dense else None)
    mode = sparse[0]["grad_accum_mode"]
    counts = sparse[0]["counts"]
    matrices = preset_matrices(s.model, METHOD)
    if {n: m["frame"] for n, m in matrices.items()} != {n: tuple(v) for n, v in sparse[0]["shapes"].items()}:
        raise RuntimeError("scale_check: backbone_matrices() differs from the model the trainer built")
    sparse_analytic = backbone_analytic(matrices, method_config(METHOD), world_size, mode,
                                        num_buckets=FULL_NUM_BUCKETS)
    dense_analytic = backbone_analytic(dense_matrices(matrices), method_config(DENSE_METHOD), world_size, mode,
                                       num_buckets=FULL_NUM_BUCKETS)
    analytic = [{"dense_side": r["parts"]["dense_side"], "backbone": state_parts(dense_analytic[rank])}
                for rank, r in enumerate(sparse)]
    tables = {model: scale_table(preset_matrices(model, METHOD), METHOD, DENSE_METHOD, WORLD_SIZES, ACCUM_MODES,
                                 FULL_NUM_BUCKETS) for model in ANALYTIC_MODELS}

    # Per-rank figures; the headline ratios use the larger rank of each side (the one that must fit).
    backbone = [r["parts"]["backbone"] for r in sparse]
    dense_backbone = max(sum(a["backbone"].values()) for a in analytic)
    sparse_total = max(rank_total(r["parts"]) for r in sparse)
    figures = [Figure("backbone_state_bytes_over_dense_adamw", max(sum(b.values()) for b in backbone) / dense_backbone,
                      TARGET),
               *(Figure(f"grad_bytes_W{GRAD_TARGET_W}_sharded_over_full_{model}",
                        table[f"W={GRAD_TARGET_W} sharded"]["grad_over_full_mode"], GRAD_TARGET)
                 for model, table in tables.items())]
    rest: dict[str, Any] = {
        "peak_rss_gb_per_rank": [r["peak_rss_gb"] for r in sparse],
        "peak_rss_over_idle_gb_per_rank": [r["peak_rss_gb"] - r["idle_rss_gb"] for r in sparse],
        "backbone_state_bytes_over_dense_adamw_without_index_cache":
            max(sum(b.values()) - b["index_cache"] for b in backbone) / dense_backbone,
        "model_state_bytes_over_dense_adamw": sparse_total / max(rank_total(a) for a in analytic),
        "model_state_bytes_over_classic_zero2":
            sparse_total / classic_zero2_bytes(counts["total_dense_equivalent"], world_size),
        "backbone_grad_transient_peak_bytes_per_rank": [r["grad_transient_peak"] for r in sparse],
        "model_state_bytes_per_rank": {f"rank{i}": r["parts"] for i, r in enumerate(sparse)},
        "backbone_bytes_per_rank_analytic": {f"rank{i}": a for i, a in enumerate(sparse_analytic)},
        "dense_adamw_bytes_per_rank_analytic": {f"rank{i}": a for i, a in enumerate(analytic)},
        "classic_zero2_bytes_per_rank_analytic": classic_zero2_bytes(counts["total_dense_equivalent"], world_size),
        **{f"analytic_largest_rank_{model}": table for model, table in tables.items()},
        "steps": {f"rank{i}": r["steps"] for i, r in enumerate(sparse)},
        "built_peak_rss_gb_per_rank": [r["built_peak_rss_gb"] for r in sparse],
    }
    if measured is not None:
        rest["dense_adamw_bytes_per_rank_measured"] = {f"rank{i}": r["parts"] for i, r in enumerate(measured)}
    config = {"model": s.model, "method": METHOD, "dense_method": DENSE_METHOD, "vocab_size": s.vocab,
              "world_size": world_size, "backend": "gloo", "threads_per_rank": 1, "dtype": "fp32 (CPU)",
              "seq_len": SEQ_LEN, "micro_batch_per_rank": MICRO_BATCH, "steps": STEPS,
              "update_interval": UPDATE_INTERVAL, "meta_device_init": True,
              "grad_accum_mode": f"{s.grad_accum_mode} (ran as {mode})",
              "ds_config": "configs/ds/zero2.json (ZeRO-2) via build_ds_config, reduce and all-gather buckets "
                           f"of {DS_BUCKET_ELEMENTS} elements",
              "overrides": list(MEMORY_OVERRIDES), "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
              "parameter_counts": counts,
              "dense_adamw_accounting": "analytic from layer shapes, same accumulation mode" + (
                  ", checked by a measured run" if s.measure_dense else " (a dense run was not made)"),
              "analytic": f"backbone_analytic at W = {', '.join(map(str, WORLD_SIZES))}: the engine's owner "
                          "map, bucket_layout and grad_bytes from the config's shapes; largest rank; full mode "
                          f"with {FULL_NUM_BUCKETS} bucket(s), sharded with the default engine.bucket_bytes",
              "bytes_read": "last step, after backward, before the optimizer step; max over ranks in ratios",
              "peak_rss": "VmHWM of /proc/self/status in GiB, reset after imports and process-group start; "
                          "over_idle: less the resident set at that reset",
              "not_counted": "DeepSpeed's ZeRO-2 reduce bucket (reduce_bucket_size elements), the engine's value "
                             "all-gather staging (send and receive chunks), buffers inside the collectives and "
                             "activations; the gradient transient peak is reported apart from the parts",
              "target": {"backbone_state_bytes_over_dense_adamw": f"<= {TARGET}",
                         f"grad_bytes_W{GRAD_TARGET_W}_sharded_over_full": f"<= {GRAD_TARGET:.5f}"}}
    head = (f"{s.model}: {METHOD} on {world_size} gloo ranks x 1 thread, seq {SEQ_LEN}, micro-batch {MICRO_BATCH}, "
            f"{STEPS} steps (refresh at step {UPDATE_INTERVAL}: "
            f"{all(r['steps'][UPDATE_INTERVAL - 1]['refreshed'] for r in sparse)}), gradients {mode}; dense AdamW "
            f"{'analytic, checked by a measured run' if measured else 'analytic'}\npeak RSS per rank (GiB): "
            f"{', '.join(f'{g:.2f}' for g in rest['peak_rss_gb_per_rank'])} (over idle: "
            f"{', '.join(f'{g:.2f}' for g in rest['peak_rss_over_idle_gb_per_rank'])})")
    return finish(json_path, figures, rest, config,
                  [parts_table(sparse, measured, sparse_analytic, analytic, dense_analytic), analytic_table(tables)],
                  head)


def _with_transient(r: dict) -> dict[str, int]:
    return {**r["parts"]["dense_side"], **r["parts"]["backbone"], "grad_transient_peak": r["grad_transient_peak"]}


def parts_table(sparse: list, measured: list | None, sparse_analytic: list, analytic: list,
                dense_analytic: list) -> tuple[list[str], list[list[Any]]]:
    """Parts in MiB: the 1:4 run measured and as modelled, dense AdamW modelled (and measured)."""
    world_size = len(sparse)
    columns = [[_with_transient(r) for r in sparse],
               [{**r["parts"]["dense_side"], **a} for r, a in zip(sparse, sparse_analytic)],
               [{**a["dense_side"], **d} for a, d in zip(analytic, dense_analytic)]]
    headers = ["part (MiB)", *(f"1:4 rank{i}" for i in range(world_size)),
               *(f"1:4 rank{i} (analytic)" for i in range(world_size)),
               *(f"dense_adamw rank{i} (analytic)" for i in range(world_size))]
    if measured is not None:
        columns.append([_with_transient(r) for r in measured])
        headers += [f"dense_adamw rank{i} (measured)" for i in range(world_size)]
    rows = [[f"{side}/{name}", *(c.get(name, 0) / 2**20 for group in columns for c in group)]
            for side, names in (("dense_side", DENSE_PARTS), ("backbone", BACKBONE_PARTS + ("grad_transient_peak",)))
            for name in names]
    return headers, rows


def analytic_table(tables: dict) -> tuple[list[str], list[list[Any]]]:
    rows = [[name, key, *(row[k] / 2**20 for k in ("grad_buffer", "grad_transient_peak", "backbone_state")),
             row["backbone_state_over_dense_adamw"], row["grad_over_full_mode"]]
            for name, table in tables.items() for key, row in table.items()]
    return (["model", "W, mode", "grad MiB", "grad transient MiB", "backbone state MiB", "over dense AdamW",
             "grad / full mode"], rows)


if __name__ == "__main__":
    for key, value in MALLOC_ENV.items():   # inherited by the spawned ranks
        os.environ.setdefault(key, value)
    main()
