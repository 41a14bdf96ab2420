"""Scale check (issue 9 item 5, issue 19 item 3; DESIGN decision 16): a 1:4 CHTsNM model built on the meta device
trains a few steps on 2 CPU ranks, and this reports peak memory and model-state bytes per rank by part, next to the
same accounting for dense AdamW under ZeRO-2; then, from the engine's own layout rules, the backbone's bytes per
rank at W = 2, 8, 64 and 512 for 350m and 1b in both gradient accumulation modes. Run by hand, not in CI (a 1B
step takes minutes on 2 cores):

    python tools/scale_check.py --model 1b --json out.json      # or 350m; --model tiny is the test suite's run

The run: `chtsnm_nobranch_1of4_row` (TANS backbone, CHTs refresh), sequence 256, micro-batch 1 per rank,
3 optimizer steps with `method.topology.update_interval=2`, so step 2 refreshes every mask; configs/ds/zero2.json
with 5e7-element buckets, fp32 on CPU, vocab 32000 (synthetic tokens), `model.meta_device_init=true`,
`model.activation_checkpointing=true`, `engine.grad_accum_mode` from --grad-accum-mode (default auto: sharded at
W = 2 with one micro-batch), `engine.num_buckets=1` (full mode's least padding), the default
`engine.bucket_bytes` (sharded mode).

Bytes per rank (DESIGN s6: sums of `untyped_storage().nbytes()` over deduplicated tensors), read at the last step
after backward and before the optimizer step, when gradients are held too:
  dense side (DeepSpeed ZeRO-2: embeddings, norms, LM head)
    module_copy        the dense-side parameters of the module (DeepSpeed's flat buffer)
    fp32_partition     the optimizer's fp32 master partition (a separate copy even in fp32 training)
    moments            AdamW exp_avg and exp_avg_sq of the partition
    grad_partition     ZeRO-2's gradient partition (`averaged_gradients`)
  backbone (the matrix engine)
    values             the compressed values (dense weights for dense methods) held by every rank
    codes              the packed pattern codes (uint8) -- persistent metadata
    index_cache        tensors an NMSparseLinear keeps besides values and codes, in any attribute or container
                       (none: since issue 19 the flat index is derived from the codes per call, a transient)
    optimizer_state    masters and rule state of the owned matrices (`matrix.state_bytes()` less the gradients)
    origin_codes       the step-0 codes of the owned sparse matrices (`matrix.origin_code_bytes()`)
    grad_buffer        the persistent fp32 gradients: full mode's W x shard buffer (every rank holds every
                       gradient) or sharded mode's accumulator of the rank's own matrices
Reported beside them, not in the sums: `grad_transient_peak`, the most the engine's gradient staging, wire copies
and reduce outputs held at once during the run (`MatrixEngine.grad_bytes()`). Not counted (transient, but part of
the peak): DeepSpeed's ZeRO-2 reduce bucket (`reduce_bucket_size` elements, allocated with torch.empty and touched
only up to the dense side's size), the matrix engine's value all-gather staging (send [chunk] and receive
[W x chunk] in the values' dtype, chunk <= 2^24 elements, allocated every step), buffers inside the collectives
and activations.

Dense AdamW under ZeRO-2 is the project's `dense_adamw` method under the same DeepSpeed config and the same
accounting: the same dense side (identical parameters), dense backbone weights, AdamW masters and moments of the
owned matrices (LPT owner map, as the engine computes it), and the gradients of the same accumulation mode. It is
computed analytically from the layer shapes (a dense 1B run does not fit two ranks on 24 GiB); `--measure-dense`
(implied by --model tiny) also trains it for real through the same accounting, after the sparse run in the same
rank processes (so its peak memory is not reported), and the analytic numbers are checked against it. The
classic all-in-DeepSpeed ZeRO-2 figure (module + (4 + 8 + 4) bytes x params / W) is given as a second reference.

Analytic backbone bytes (`backbone_analytic` of distsparse/memory_estimate.py, which `--dry-run` also uses): the
shapes of a preset built on the meta device, owners by the engine's LPT (`assign_owners` on `matrix_cost`), the
gradient layout by the engine's `bucket_layout` and its bytes by `grad_buckets.grad_bytes` (the transient peak
assuming gradients arrive in layout order, as LLaMA's backward delivers them), rule state by `init_state`; the largest rank is reported. At the measured W they are checked
against the measured parts, part by part (the test suite does so at tiny). Values are fp32 as in the CPU run
(bf16 training halves them).

Peak memory per rank: VmHWM of /proc/self/status (the high-water mark of the rank's own memory image; not
ru_maxrss, which a spawned child inherits from its parent), read at the end of the run. The peak is reset
(`5` written to /proc/self/clear_refs) once the rank has imported its libraries and joined the process group, so
the peak is the run's own even in a reused process, and the resident set at that moment is the idle baseline.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Iterable
from typing import Any

import torch

from bench_train import spawn_ranks, write_synthetic_data
from benchlib import add_json_arg, machine_info, print_table, write_json
from distsparse.memory_estimate import (BACKBONE_PARTS, DENSE_PARTS, backbone_analytic, classic_zero2_bytes,
                                        dense_matrices, method_config, preset_matrices, scale_table, state_parts)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny", "350m", "1b")
ANALYTIC_MODELS = ("350m", "1b")
WORLD_SIZES = (2, 8, 64, 512)      # analytic: the measured W and beyond
ACCUM_CHOICES = ("auto", "full", "sharded")
ACCUM_MODES = ("full", "sharded")
METHOD = "chtsnm_nobranch_1of4_row"
DENSE_METHOD = "dense_adamw"
VOCAB = 32000
QUICK_VOCAB = 512
STEPS = 3
UPDATE_INTERVAL = 2
SEQ_LEN = 256
MICRO_BATCH = 1
# What a user fitting 1b on two ranks of 24 GiB sets (DeepSpeed's default 5e8-element buckets are sized for GPUs).
# Full mode pads every rank's shard of a bucket to the largest, so one bucket holds the fewest bytes (at W = 64
# eight buckets would hold 4x more); the measured and the analytic full mode both use it.
FULL_NUM_BUCKETS = 1
MEMORY_OVERRIDES = ("model.activation_checkpointing=true", f"engine.num_buckets={FULL_NUM_BUCKETS}")
DS_BUCKET_ELEMENTS = 50_000_000
# glibc raises its mmap threshold (up to 32 MiB) after each large free, so the many 10-45 MiB per-matrix
# temporaries of a refresh land in the heap and stay resident after being freed; a fixed 1 MiB threshold returns
# every large tensor to the system when it dies (mallopt(3), M_MMAP_THRESHOLD). The command line sets it for the
# ranks it spawns.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
TARGET = 0.26                      # issue 19: backbone_state_bytes_over_dense_adamw <= 0.26
GRAD_TARGET_W, GRAD_TARGET = 64, 1 / 32   # issue 19: gradient bytes per rank at W = 64, sharded / full


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_arg(p)
    p.add_argument("--model", required=True, choices=MODELS, help="model preset (tiny: the test suite's run)")
    p.add_argument("--measure-dense", action="store_true",
                   help="also train dense_adamw for real and measure it (implied by --model tiny)")
    p.add_argument("--grad-accum-mode", default="auto", choices=ACCUM_CHOICES,
                   help="engine.grad_accum_mode of the measured runs (default auto: sharded at W = 2)")
    args = p.parse_args(argv)
    args.vocab = QUICK_VOCAB if args.model == "tiny" else VOCAB
    args.measure_dense = args.measure_dense or args.model == "tiny"
    return args


# ---- bytes --------------------------------------------------------------------------------------------------------

def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set) -> int:
    """Bytes of the storages behind `tensors` not already in `seen` (views and aliases count once)."""
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def dense_side_bytes(trainer, seen: set) -> dict[str, int]:
    """DeepSpeed ZeRO-2's model state on this rank (call after backward, before engine.step)."""
    from distsparse.train.trainer import dense_side_parameters

    opt = trainer.engine.optimizer
    params = [p for group in dense_side_parameters(trainer.model, trainer.backbone) for p in group["params"]]
    moments = [v for state in opt.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    grads = [g for group in opt.averaged_gradients.values() if group for g in group]   # {group index: [grads]}
    return {"module_copy": storage_bytes(params, seen),
            "fp32_partition": storage_bytes(opt.single_partition_of_fp32_groups, seen),
            "moments": storage_bytes(moments, seen),
            "grad_partition": storage_bytes(grads, seen)}


def index_cache_bytes(layers: Iterable[torch.nn.Module], seen: set) -> int:
    """Bytes of every tensor the layers hold besides their parameters and buffers (values, codes): any attribute,
    also inside lists, dicts and dataclasses (bench_layer.held_tensors), so a cache cannot hide in a container."""
    from bench_layer import held_tensors

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
            "optimizer_state": matrix.state_bytes() - storage_bytes(grads, set()),
            "origin_codes": matrix.origin_code_bytes(),
            "grad_buffer": storage_bytes(grads, seen)}


# ---- per rank ----------------------------------------------------------------------------------------------------

def _status_gb(field: str) -> float:
    """A memory line of /proc/self/status (VmHWM: peak resident set, VmRSS: current), in GiB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20   # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _rss_gb() -> float:
    return _status_gb("VmHWM")


def _reset_peak_rss() -> None:
    """Set VmHWM to the current resident set (Linux >= 4.0, proc(5) clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


def _train_and_count(rank: int, model: str, method: str, vocab: int, data_dir: str, out_dir: str,
                     grad_accum_mode: str) -> dict:
    """Build `method` on the meta device, train STEPS steps, return its bytes by part, step log and shapes."""
    from distsparse.config import load_config
    from distsparse.models import parameter_counts
    from distsparse.train.ds_config import build_ds_config
    from distsparse.train.trainer import Trainer

    start = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"scale_check: [{time.perf_counter() - start:.0f}s] {method}: {msg}", file=sys.stderr, flush=True)

    overrides = [f"model.preset={model}", f"method.preset={method}", "model.meta_device_init=true",
                 f"model.vocab_size={vocab}", f"data.dir={data_dir}", f"data.seq_len={SEQ_LEN}",
                 f"train.micro_batch={MICRO_BATCH}", "train.grad_accum=1", f"train.steps={STEPS}",
                 f"train.out_dir={Path(out_dir) / method}", f"engine.grad_accum_mode={grad_accum_mode}",
                 *MEMORY_OVERRIDES]
    if method != DENSE_METHOD:
        overrides.append(f"method.topology.update_interval={UPDATE_INTERVAL}")
    cfg = load_config(None, overrides)
    log("building on the meta device")
    ds_config = build_ds_config(ROOT / "configs/ds/zero2.json", cfg)
    ds_config["zero_optimization"].update(reduce_bucket_size=DS_BUCKET_ELEMENTS,
                                          allgather_bucket_size=DS_BUCKET_ELEMENTS)
    trainer = Trainer(cfg, ds_config)
    counts = parameter_counts(trainer.model)
    built_rss_gb = _rss_gb()
    log(f"built ({built_rss_gb:.2f} GiB peak RSS so far): {counts}")
    parts: dict[str, dict[str, int]] = {}
    engine_step = trainer.engine.step

    def step_and_count(*args, **kwargs):
        if trainer.step == STEPS - 1:   # the last step, gradients held
            seen: set = set()
            parts["dense_side"] = dense_side_bytes(trainer, seen)
            parts["backbone"] = backbone_bytes(trainer, seen)
        return engine_step(*args, **kwargs)

    # A memory snapshot inside the step (gradients held, before DeepSpeed's update): the step's report times phases
    # but holds no bytes, so this one wrap stays.
    trainer.engine.step = step_and_count
    steps = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        metrics = trainer.step_once().metrics
        steps.append({"seconds": time.perf_counter() - t0, "loss": metrics["loss/train"],
                      "refreshed": "topology/refresh_s" in metrics, "peak_rss_gb_so_far": _rss_gb()})
        log(f"step {trainer.step}/{STEPS}: {steps[-1]['seconds']:.1f}s, loss {steps[-1]['loss']:.4f}, "
            f"refresh {steps[-1]['refreshed']}, peak RSS so far {steps[-1]['peak_rss_gb_so_far']:.2f} GiB")
    grads = trainer.matrix.grad_bytes()
    trainer.close()
    shapes = {name: (m.out_features, m.in_features) for name, m in trainer.backbone.items()}
    return {"parts": parts, "steps": steps, "shapes": shapes, "counts": counts, "built_peak_rss_gb": built_rss_gb,
            "grad_accum_mode": trainer.matrix.grad_accum_mode, "grad_transient_peak": grads["transient_peak"]}


def _rank_main(rank: int, world_size: int, model: str, methods: list[str], vocab: int, data_dir: str,
               out_dir: str, grad_accum_mode: str) -> list[dict]:
    """Each method in turn; peak RSS is that of the first (later ones share the process, so only its peak is
    that method's own)."""
    import deepspeed  # noqa: F401  (imported before the trainer, as launch/pretrain.py does)
    import distsparse.train.trainer  # noqa: F401  (part of the idle baseline)

    gc.collect()
    _reset_peak_rss()
    idle_gb = _status_gb("VmRSS")
    results = []
    for i, method in enumerate(methods):
        result = _train_and_count(rank, model, method, vocab, data_dir, out_dir, grad_accum_mode)
        if i == 0:
            result.update(peak_rss_gb=_rss_gb(), idle_rss_gb=idle_gb)
        results.append(result)
        gc.collect()
    return results


# ---- driver ------------------------------------------------------------------------------------------------------

def run(model: str, methods: list[str], vocab: int, world_size: int = 2, grad_accum_mode: str = "auto",
        runner: Callable[..., list] = spawn_ranks) -> list[list[dict]]:
    """[method][rank] results of one run of `world_size` ranks; `runner(fn, world_size, *args)` runs fn on
    every rank (default: fresh processes; the test suite passes its shared rank pool)."""
    with tempfile.TemporaryDirectory(prefix="scale_check_") as tmp:
        data_dir = write_synthetic_data(Path(tmp) / "data", vocab, 64 * SEQ_LEN)
        per_rank = runner(_rank_main, world_size, model, methods, vocab, data_dir, str(Path(tmp) / "run"),
                          grad_accum_mode)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(methods))]


def _total(parts: dict[str, dict[str, int]]) -> int:
    return sum(sum(side.values()) for side in parts.values())


def main(argv: list[str] | None = None, runner: Callable[..., list] = spawn_ranks) -> dict[str, Any]:
    args = parse_args(argv)
    world_size = 2
    # The dense run, when measured, follows in the same processes: only the sparse run's peak RSS is its own.
    runs = run(args.model, [METHOD, DENSE_METHOD] if args.measure_dense else [METHOD], args.vocab, world_size,
               args.grad_accum_mode, runner)
    sparse, measured = runs[0], (runs[1] if args.measure_dense else None)
    mode = sparse[0]["grad_accum_mode"]
    counts = sparse[0]["counts"]
    matrices = preset_matrices(args.model, METHOD)
    built = {n: tuple(s) for n, s in sparse[0]["shapes"].items()}
    if {n: m["frame"] for n, m in matrices.items()} != built:
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
    sparse_backbone = max(sum(r["parts"]["backbone"].values()) for r in sparse)
    sparse_backbone_no_cache = max(sum(r["parts"]["backbone"].values()) - r["parts"]["backbone"]["index_cache"]
                                   for r in sparse)
    dense_backbone = max(sum(a["backbone"].values()) for a in analytic)
    classic = classic_zero2_bytes(counts["total_dense_equivalent"], world_size)
    sparse_total = max(_total(r["parts"]) for r in sparse)
    payload: dict[str, Any] = {
        "peak_rss_gb_per_rank": [r["peak_rss_gb"] for r in sparse],
        "peak_rss_over_idle_gb_per_rank": [r["peak_rss_gb"] - r["idle_rss_gb"] for r in sparse],
        "backbone_state_bytes_over_dense_adamw": sparse_backbone / dense_backbone,
        "backbone_state_bytes_over_dense_adamw_without_index_cache": sparse_backbone_no_cache / dense_backbone,
        "model_state_bytes_over_dense_adamw": sparse_total / max(_total(a) for a in analytic),
        "model_state_bytes_over_classic_zero2": sparse_total / classic,
        "backbone_grad_transient_peak_bytes_per_rank": [r["grad_transient_peak"] for r in sparse],
        **{f"grad_bytes_W{GRAD_TARGET_W}_sharded_over_full_{model}":
           table[f"W={GRAD_TARGET_W} sharded"]["grad_over_full_mode"] for model, table in tables.items()},
        "model_state_bytes_per_rank": {f"rank{i}": r["parts"] for i, r in enumerate(sparse)},
        "backbone_bytes_per_rank_analytic": {f"rank{i}": a for i, a in enumerate(sparse_analytic)},
        "dense_adamw_bytes_per_rank_analytic": {f"rank{i}": a for i, a in enumerate(analytic)},
        "classic_zero2_bytes_per_rank_analytic": classic,
        **{f"analytic_largest_rank_{model}": table for model, table in tables.items()},
        "steps": {f"rank{i}": r["steps"] for i, r in enumerate(sparse)},
        "built_peak_rss_gb_per_rank": [r["built_peak_rss_gb"] for r in sparse],
        "machine": machine_info(),
        "config": {"model": args.model, "method": METHOD, "dense_method": DENSE_METHOD, "vocab_size": args.vocab,
                   "world_size": world_size, "backend": "gloo", "threads_per_rank": 1, "dtype": "fp32 (CPU)",
                   "seq_len": SEQ_LEN, "micro_batch_per_rank": MICRO_BATCH, "steps": STEPS,
                   "update_interval": UPDATE_INTERVAL, "meta_device_init": True,
                   "grad_accum_mode": f"{args.grad_accum_mode} (ran as {mode})",
                   "ds_config": "configs/ds/zero2.json (ZeRO-2) via build_ds_config, reduce and all-gather buckets "
                                f"of {DS_BUCKET_ELEMENTS} elements",
                   "overrides": list(MEMORY_OVERRIDES),
                   "malloc_env": {k: os.environ.get(k) for k in MALLOC_ENV},
                   "parameter_counts": counts,
                   "dense_adamw_accounting": "analytic from layer shapes, same accumulation mode" + (
                       ", checked by a measured run" if args.measure_dense else " (a dense run was not made)"),
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
                              f"grad_bytes_W{GRAD_TARGET_W}_sharded_over_full": f"<= {GRAD_TARGET:.5f}"}},
    }
    if measured is not None:
        payload["dense_adamw_bytes_per_rank_measured"] = {f"rank{i}": r["parts"] for i, r in enumerate(measured)}
    if args.json:
        write_json(args.json, payload)
    _print_report(args.model, payload, sparse, measured, sparse_analytic, analytic, dense_analytic, tables, mode)
    return payload


def _print_report(model: str, payload: dict, sparse: list, measured: list | None, sparse_analytic: list,
                  analytic: list, dense_analytic: list, tables: dict, mode: str) -> None:
    """The console report: headline figures, the parts table (measured and modelled), the analytic table last."""
    world_size = len(sparse)
    ratio = payload["backbone_state_bytes_over_dense_adamw"]
    print(f"\n{model}: {METHOD} on {world_size} gloo ranks x 1 thread, seq {SEQ_LEN}, micro-batch {MICRO_BATCH}, "
          f"{STEPS} steps (refresh at step {UPDATE_INTERVAL}: "
          f"{all(r['steps'][UPDATE_INTERVAL - 1]['refreshed'] for r in sparse)}), gradients {mode}; dense AdamW "
          f"{'analytic, checked by a measured run' if measured else 'analytic'}")
    print(f"peak RSS per rank (GiB): {', '.join(f'{g:.2f}' for g in payload['peak_rss_gb_per_rank'])} "
          f"(over idle: {', '.join(f'{g:.2f}' for g in payload['peak_rss_over_idle_gb_per_rank'])})")
    print(f"backbone_state_bytes_over_dense_adamw = {ratio:.3f} (target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'MISSED'}); without the index cache "
          f"{payload['backbone_state_bytes_over_dense_adamw_without_index_cache']:.3f}")
    for name, table in tables.items():
        grad = table[f"W={GRAD_TARGET_W} sharded"]["grad_over_full_mode"]
        print(f"{name}: gradient bytes per rank at W = {GRAD_TARGET_W}, sharded / full = 1/{1 / grad:.0f} "
              f"(target <= 1/{1 / GRAD_TARGET:.0f}: {'met' if grad <= GRAD_TARGET else 'MISSED'})")
    # Columns: the 1:4 run measured and as modelled, dense AdamW modelled (and measured); the transient peak apart.
    columns = [[{**r["parts"]["dense_side"], **r["parts"]["backbone"], "grad_transient_peak": r["grad_transient_peak"]}
                for r in sparse],
               [{**r["parts"]["dense_side"], **a} for r, a in zip(sparse, sparse_analytic)],
               [{**a["dense_side"], **d} for a, d in zip(analytic, dense_analytic)]]
    headers = ["part (MiB)", *(f"1:4 rank{i}" for i in range(world_size)),
               *(f"1:4 rank{i} (analytic)" for i in range(world_size)),
               *(f"dense_adamw rank{i} (analytic)" for i in range(world_size))]
    if measured is not None:
        columns.append([{**r["parts"]["dense_side"], **r["parts"]["backbone"],
                         "grad_transient_peak": r["grad_transient_peak"]} for r in measured])
        headers += [f"dense_adamw rank{i} (measured)" for i in range(world_size)]
    rows = [[f"{side}/{name}", *(c.get(name, 0) / 2**20 for group in columns for c in group)]
            for side, names in (("dense_side", DENSE_PARTS), ("backbone", BACKBONE_PARTS + ("grad_transient_peak",)))
            for name in names]
    print_table(headers, rows)
    print()
    rows = [[name, key, *(row[k] / 2**20 for k in ("grad_buffer", "grad_transient_peak", "backbone_state")),
             row["backbone_state_over_dense_adamw"], row["grad_over_full_mode"]]
            for name, table in tables.items() for key, row in table.items()]
    print_table(["model", "W, mode", "grad MiB", "grad transient MiB", "backbone state MiB", "over dense AdamW",
                 "grad / full mode"], rows)


if __name__ == "__main__":
    for key, value in MALLOC_ENV.items():   # inherited by the spawned ranks
        os.environ.setdefault(key, value)
    main()
