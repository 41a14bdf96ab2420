"""Training speed (issue 9 item 3; CHTsNM paper Table A13): per-step phases and tokens/s of six methods on 2 ranks,
every row paired with dense AdamW; aten ops and host syncs of one steady step per row. The phases are the step's own
report (`Trainer.step_once`); how it pairs, amortizes the refresh and counts FLOPs: docs/benchmarks.md.

    python -m bench.train model=60m --json out.json
    python -m bench.train model=350m rows=dense_adamw,chtsnm_nobranch_1of4_row --json out.json
    python -m bench.train --quick --json out.json       # tiny model, 2 steps (the test suite's smoke run)
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.core import Figure, Settings, finish, parse, progress
from bench.ranks import RankPool, on_ranks
from bench.synthetic import write_synthetic_data
from bench.trainers import ROOT, build_trainer
from distsparse.perf.flops import device_peak_flops, mfu, model_step_flops

ROWS = {   # preset -> Table A13 label
    "dense_adamw": "dense AdamW",
    "dense_muon": "dense Muon",
    "dense_tans": "dense TANS",
    "chtsnm_nobranch_1of4_row": "CHTs 1:4 + TANS",
    "chts_muon_1of4_row": "CHTs 1:4 + Muon",
    "chtsnm_nobranch_2of4_row": "CHTs 2:4 + TANS",
}
REFERENCE = "dense_adamw"
RATIO_ROW = "chtsnm_nobranch_1of4_row"
RATIO_KEY = "chts_1of4_tans_over_dense_adamw"
TARGET = 0.70                      # issue 9, on CPU (0.75 aimed at on a GPU)
TOTAL_STEPS = 10000                # the schedules' horizon (lr, T_end); only the refresh step's zeta_t depends on it
BOUNDARY = ("reduce", "dense_step", "backbone_step", "gather")   # the accumulation boundary but the refresh
MEDIAN_KEYS = ("data", "forward", "backward", *BOUNDARY, "optimizer", "step")
COUNT_KEYS = ("ops_per_step", "ops_per_fwd_bwd", "host_syncs_per_step")


@dataclass
class TrainSettings(Settings):
    model: str = "60m"            # configs/model/*.yaml
    vocab: int = 32000            # DESIGN s6; the smoke run's 512 only checks keys
    steps: int = 5                # timed steps per row
    warmup: int = 2               # untimed steps per trainer first
    micro_batch: int = 8          # sequences per rank
    seq_len: int = 256
    nproc: int = 0                # ranks; 0: 2 on CPU, min(2, GPUs) with CUDA (NCCL needs one GPU per rank)
    rows: str = ",".join(ROWS)    # comma-separated; REFERENCE and RATIO_ROW always needed
    QUICK = {"model": "tiny", "vocab": 512, "steps": 2, "warmup": 1, "micro_batch": 2, "seq_len": 64}

    def __post_init__(self) -> None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.nproc = self.nproc or (min(2, gpus) if gpus else 2)
        self.at_least(steps=1, micro_batch=1, seq_len=1, nproc=1, warmup=0)
        if gpus and self.nproc > gpus:
            raise ValueError(f"nproc: got {self.nproc}; allowed: 1 .. {gpus} (NCCL: one GPU per rank)")
        rows = self.row_list
        if any(r not in ROWS for r in rows) or REFERENCE not in rows or RATIO_ROW not in rows:
            raise ValueError(f"rows: got {self.rows!r}; allowed: a comma-separated subset of {', '.join(ROWS)} "
                             f"holding {REFERENCE} and {RATIO_ROW}")
        self.one_of(model=sorted(q.stem for q in (ROOT / "configs" / "model").glob("*.yaml")))

    @property
    def row_list(self) -> list[str]:
        return [r.strip() for r in self.rows.split(",") if r.strip()]


# ---- per rank: the trainer's own step reports ------------------------------------------------------------------

def timed_step(trainer, sync: Callable[[], None], energy: Callable[[], float] | None) -> dict[str, float]:
    """One optimizer step through `Trainer.step_once`, its phases from the step's own report (StepReport.timings:
    CUDA events on GPUs, perf_counter on CPU); `sync` brackets the step's wall time."""
    joules = energy() if energy else 0.0
    sync()
    t0 = time.perf_counter()
    report = trainer.step_once(timed=True)
    sync()
    step_s = time.perf_counter() - t0
    out = {key.split("/", 1)[1]: value for key, value in report.timings.items()}
    out["optimizer"] = sum(out[k] for k in BOUNDARY)
    out["step"] = step_s
    out["joules"] = (energy() - joules) if energy else None
    out["refreshed"] = any(k.startswith("topology/") for k in report.metrics)
    return out


def counted_step(trainer) -> dict[str, Any]:
    """One optimizer step under an OpCounter: aten ops of the step and per phase (the step timer's clock is the op
    count), and host syncs (host tensors, e.g. torch Adam's step counters, excluded: op_count.py)."""
    from distsparse.op_count import OpCounter

    with OpCounter(host_tensors=trainer.host_tensors()) as counter, \
            trainer.timer.use_clock(lambda: counter.counts.ops):
        report = trainer.step_once(timed=True)
    by_phase = {key.split("/", 1)[1]: int(value) for key, value in report.timings.items()}
    return {"ops_per_step": counter.counts.ops, "ops_per_fwd_bwd": by_phase["forward"] + by_phase["backward"],
            "host_syncs_per_step": counter.counts.syncs, "sync_ops": dict(counter.counts.sync_ops),
            "ops_by_phase": by_phase}


def _energy_reader(rank: int) -> tuple[Callable[[], float] | None, str | None]:
    """(joules-so-far reader for this rank's GPU, None) or (None, why energy is skipped)."""
    if not torch.cuda.is_available():
        return None, "CPU run: no energy counter read (NVML is NVIDIA-only)"
    try:
        import pynvml
    except ImportError:
        return None, "pynvml not installed (pip install -e '.[gpu]')"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(rank)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except pynvml.NVMLError as err:
        return None, f"NVML energy counter unavailable: {err}"
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0, None   # mJ -> J


def flops_per_step(trainer, seq_len: int, tokens: int) -> float:
    """Dense-equivalent FLOPs of one step of `trainer`'s model over `tokens` tokens (docs/benchmarks.md)."""
    return model_step_flops(trainer.model, seq_len, tokens).dense_equivalent


def mfu_by_row(rows: dict[str, dict[str, Any]], flops: float, peak: float | None, world_size: int) -> dict:
    """Per row, MFU of `flops` per step over its effective step time (None without a peak)."""
    return {m: (mfu(flops, r["effective_step_s"], peak, world_size) if peak else None) for m, r in rows.items()}


def _rank_main(rank: int, world_size: int, s: TrainSettings, data_dir: str, out_root: str) -> dict:
    from distsparse.models import parameter_counts

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    energy, energy_skipped = _energy_reader(rank)
    log = progress("bench.train", rank)

    def build(method: str):
        return build_trainer([f"model.preset={s.model}", f"method.preset={method}", f"model.vocab_size={s.vocab}",
                              f"data.dir={data_dir}", f"data.seq_len={s.seq_len}", f"train.micro_batch={s.micro_batch}",
                              "train.grad_accum=1", f"train.steps={TOTAL_STEPS}",
                              f"train.out_dir={Path(out_root) / method}"], torch_adam=True)

    def step(trainer) -> dict[str, float]:
        out = timed_step(trainer, sync, energy)
        assert not out.pop("refreshed"), "a timed step refreshed: the timed steps must stay below update_interval"
        return out

    def warm(trainer) -> dict[str, Any]:
        for _ in range(s.warmup):
            trainer.step_once(timed=False)
        return counted_step(trainer)   # one steady step, counted (not timed)

    log(f"{REFERENCE}: building and warming up")
    reference = build(REFERENCE)
    counts_by_row = {REFERENCE: warm(reference)}
    counts = parameter_counts(reference.model)
    flops = flops_per_step(reference, s.seq_len, s.micro_batch * s.seq_len * world_size)
    steps: dict[str, list[dict]] = {m: [] for m in s.row_list}
    refresh: dict[str, dict | None] = {REFERENCE: None}
    intervals: dict[str, int | None] = {REFERENCE: None}
    for method in s.row_list:
        if method == REFERENCE:
            continue
        log(f"{method}: building and warming up")
        trainer = build(method)
        counts_by_row[method] = warm(trainer)
        topo = trainer.cfg.method.topology
        intervals[method] = topo.update_interval if topo.enabled else None
        log(f"{method}: {s.steps} timed rounds paired with {REFERENCE}")
        for r in range(s.steps):
            pair = [(REFERENCE, reference), (method, trainer)]
            for name, t in (pair if r % 2 == 0 else pair[::-1]):
                steps[name].append({"partner": method, "round": r, **step(t)})
        refresh[method] = None
        if topo.enabled:
            # Midpoint of the refresh period: the refresh step nearest T_end / 2.
            t_end, every = trainer.topology.t_end, topo.update_interval
            trainer.seek(max(every, round(t_end / 2 / every) * every) - 1)
            log(f"{method}: one refresh step (step {trainer.step + 1}, T_end {t_end})")
            refresh[method] = timed_step(trainer, sync, energy)
            assert refresh[method].pop("refreshed"), f"{method}: step {trainer.step} did not refresh"
        trainer.close()
        del trainer
        gc.collect()
    reference.close()
    log("done")
    return {"steps": steps, "refresh": refresh, "intervals": intervals, "flops_per_step": flops,
            "parameter_counts": counts, "energy_skipped": energy_skipped, "counts": counts_by_row}


# ---- combining the ranks ---------------------------------------------------------------------------------------

def slowest_rank(records: list[dict]) -> dict:
    """The phases of the rank whose step took longest (the step ends when it does); joules summed over ranks."""
    slowest = max(records, key=lambda rec: rec["step"])
    joules = [rec.get("joules") for rec in records]
    return {**slowest, "joules": sum(joules) if all(j is not None for j in joules) else None}


def combine_counts(per_rank: list[dict]) -> dict[str, dict[str, int]]:
    """Per row, each count of COUNT_KEYS of the rank that dispatched most (the launch-bound rank sets the step)."""
    rows = per_rank[0]["counts"]
    return {m: {key: max(rk["counts"][m][key] for rk in per_rank) for key in COUNT_KEYS} for m in rows}


def summarize(per_rank: list[dict], tokens_per_step: int) -> dict[str, Any]:
    """Per-row medians, amortized refresh, tokens/s and paired ratios to the reference from every rank's records."""
    first = per_rank[0]
    rows: dict[str, dict[str, Any]] = {}
    combined = {m: [slowest_rank([rk["steps"][m][i] for rk in per_rank]) for i in range(len(first["steps"][m]))]
                for m in first["steps"]}
    for method, records in combined.items():
        phases = {k: statistics.median(rec[k] for rec in records) for k in MEDIAN_KEYS}
        interval = first["intervals"][method]
        refresh_s = None
        if first["refresh"][method] is not None:
            refresh_s = slowest_rank([rk["refresh"][method] for rk in per_rank])["refresh"]
        phases["refresh_step"] = refresh_s if refresh_s is not None else 0.0
        phases["refresh"] = refresh_s / interval if refresh_s is not None else 0.0
        effective = phases["step"] + phases["refresh"]
        joules = [rec["joules"] for rec in records]
        rows[method] = {"phases_s": phases, "effective_step_s": effective, "tokens_per_s": tokens_per_step / effective,
                        "joules_per_token": (statistics.median(joules) / tokens_per_step
                                             if all(j is not None for j in joules) else None),
                        "update_interval": interval}
    for method, row in rows.items():
        if method == REFERENCE:
            row["over_dense_adamw"], row["reference_step_s"] = 1.0, row["phases_s"]["step"]
            continue
        ref = {rec["round"]: rec["step"] for rec in combined[REFERENCE] if rec["partner"] == method}
        ratios = [ref[rec["round"]] / (rec["step"] + row["phases_s"]["refresh"]) for rec in combined[method]]
        row["over_dense_adamw"] = statistics.median(ratios)
        row["reference_step_s"] = statistics.median(ref.values())   # shows the machine's drift between rows
    return rows


def main(argv: list[str] | None = None, pool: RankPool | None = None) -> dict[str, Any]:
    """Run every row on `nproc` ranks (a fresh pool, or the test suite's), print the tables, write the JSON."""
    s, json_path = parse(TrainSettings, argv, __doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    tokens_per_step = s.micro_batch * s.seq_len * s.nproc
    # Samples the run draws: every trainer's steps, the reference's paired ones included (the sampler wraps anyway).
    num_sequences = (s.warmup + 2 * s.steps + 1) * len(s.row_list) * s.micro_batch * s.nproc
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        data_dir = write_synthetic_data(Path(tmp) / "data", s.vocab, (num_sequences + 1) * s.seq_len)
        per_rank = on_ranks(pool, s.nproc, _rank_main, s, data_dir, str(Path(tmp) / "runs"), cuda=cuda)
    rows = summarize(per_rank, tokens_per_step)
    counts = combine_counts(per_rank)
    flops = per_rank[0]["flops_per_step"]
    peak, mfu_note = device_peak_flops(torch.device("cuda", 0) if cuda else "cpu")
    energy_skipped = per_rank[0]["energy_skipped"]
    rest: dict[str, Any] = {
        "tokens_per_s": {m: r["tokens_per_s"] for m, r in rows.items()},
        "over_dense_adamw": {m: r["over_dense_adamw"] for m, r in rows.items()},
        "phases_s": {m: r["phases_s"] for m, r in rows.items()},
        "dense_adamw_step_s_paired": {m: r["reference_step_s"] for m, r in rows.items()},
        **{key: {m: c[key] for m, c in counts.items()} for key in COUNT_KEYS},
        "counts_by_rank": [rk["counts"] for rk in per_rank],
        "achieved_tflops": {m: flops / r["effective_step_s"] / 1e12 for m, r in rows.items()},
        "mfu": mfu_by_row(rows, flops, peak, s.nproc),
        "joules_per_token": ({m: r["joules_per_token"] for m, r in rows.items()} if energy_skipped is None
                             else {"skipped": energy_skipped}),
    }
    config = {
        "model": s.model, "vocab_size": s.vocab, "world_size": s.nproc, "backend": "nccl" if cuda else "gloo",
        "threads_per_rank": None if cuda else 1, "micro_batch_per_rank": s.micro_batch, "seq_len": s.seq_len,
        "grad_accum": 1, "tokens_per_step": tokens_per_step, "warmup_steps": s.warmup, "timed_steps": s.steps,
        "quick": s.quick, "ds_config": "configs/ds/zero2.json (ZeRO-2) via build_ds_config, dense-side AdamW with "
                                       "torch_adam",
        "dtype": "bf16" if cuda else "fp32", "rows": {m: ROWS[m] for m in s.row_list},
        "update_interval": {m: r["update_interval"] for m, r in rows.items()},
        "schedule_total_steps": TOTAL_STEPS, "data": "synthetic uniform tokens",
        "parameter_counts": per_rank[0]["parameter_counts"], "flops_per_step": flops,
        "flops_convention": "dense-equivalent: 6 x (backbone dense-equivalent params + LM head) x tokens + "
                            "12 x layers x hidden x seq_len x tokens; sparse rows charged the dense FLOPs",
        "mfu_convention": mfu_note,
        "statistic": "per step the slower rank's phases; medians over timed steps; ratios: median over rounds "
                     "of t(dense_adamw) / (t(row) + refresh / update_interval), rounds alternating order",
        "refresh": "one refresh step at the refresh step nearest T_end / 2, amortized over update_interval",
        "counts": "one steady step per row after warmup under distsparse.op_count.OpCounter: aten ops per "
                  "optimizer step and per forward+backward (grad_accum 1), host syncs per step (host tensors "
                  "excluded); the rank that dispatched most",
        "target": {RATIO_KEY: f">= {TARGET} on CPU"},
    }
    headers = ["row", "forward s", "backward s", "optimizer s", "refresh s (amort.)", "step s", "tokens/s",
               f"/ {REFERENCE}", f"{REFERENCE} step s (paired)", "TFLOP/s (dense-eq.)", "ops/step", "ops/fwd+bwd",
               "syncs/step"] + (["J/token"] if energy_skipped is None else [])
    table = [[ROWS[m], r["phases_s"]["forward"], r["phases_s"]["backward"], r["phases_s"]["optimizer"],
              r["phases_s"]["refresh"], r["effective_step_s"], round(r["tokens_per_s"], 1), r["over_dense_adamw"],
              r["reference_step_s"], rest["achieved_tflops"][m], *(counts[m][key] for key in COUNT_KEYS),
              *([r["joules_per_token"]] if energy_skipped is None else [])] for m, r in rows.items()]
    head = (f"{s.model}, vocab {s.vocab}, {s.nproc} ranks x {s.micro_batch} x {s.seq_len} tokens, {s.warmup} warmup "
            f"+ {s.steps} timed steps per row (paired with {REFERENCE}); {mfu_note}"
            + (f"\nenergy: skipped ({energy_skipped})" if energy_skipped else ""))
    return finish(json_path, [Figure(RATIO_KEY, rows[RATIO_ROW]["over_dense_adamw"], TARGET, ">=")], rest, config,
                  [(headers, table)], head)


if __name__ == "__main__":
    main()
