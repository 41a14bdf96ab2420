"""The CHTs topology refresh (issue 5): one full refresh of every matrix of a 60m 1:4 backbone over one TANS step of
the same backbone, row- and block-wise (target <= 2.0), and the peak extra memory of `ch_scores` on a 1B FFN mask
over its dense fp32 bytes (target <= 4, research/cht_topology.md s6). How the rounds pair and why each timed step
runs Newton-Schulz: docs/benchmarks.md.

    python -m bench.topology --json out.json
    python -m bench.topology --quick --json out.json     # tiny shapes, for the test suite
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from bench.core import Figure, Settings, finish, parse, progress
from bench.memory import fresh_peaks
from distsparse.config import Config, load_config
from distsparse.models import backbone_modules, backbone_param, build_model
from distsparse.nm import decode
from distsparse.optim.engine import MatrixEngine
from distsparse.topology import RefreshParams, ch_scores
from distsparse.train.topology_policy import TopologyPolicy
from distsparse.train.trainer import build_matrix_engine

LAYOUTS = ("row", "block")
PRESET = "chtsnm_nobranch_1of4_{layout}"
VOCAB = 32000
TOTAL_STEPS, REFRESH_STEP = 10000, 100
WARM_TANS_STEPS = 3          # TANS state (V, P, tau) after a few steps, not the all-zero start
SCORE_SHAPE, QUICK_SCORE_SHAPE = (5464, 2048), (64, 32)
TARGET_REFRESH, TARGET_SCORE_PEAK = 2.0, 4.0
STAT_KEYS = ("groups_selected", "groups_changed", "mpr_exclusions", "links_changed")

# A fresh interpreter: argv = out, in, chunk, threads, compute (0 = the idle baseline). The mask is built from a uint8
# draw so that its construction frees no large transient that ch_scores could reuse without raising the peak; both
# processes build it and import the same modules.
_SCORE_CHILD = """
import sys
import torch
from distsparse.topology import ch_scores
out_f, in_f, chunk, threads, compute = map(int, sys.argv[1:6])
torch.set_num_threads(threads)
draw = torch.randint(0, 4, (out_f, in_f // 4, 1), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
mask = (draw == torch.arange(4, dtype=torch.uint8)).view(out_f, in_f)   # one kept link per row group: 1:4 row
del draw
if compute:
    scores = ch_scores(mask, "ch2", chunk)
"""


@dataclass
class TopologySettings(Settings):
    model: str = "60m"
    threads: int = 1          # torch CPU threads (one rank's share of 2 cores)
    warmup: int = 1           # untimed rounds
    repeats: int = 6          # timed rounds
    memory_pairs: int = 3     # (scores, idle) process pairs for the score peak, median taken
    seed: int = 0
    QUICK = {"model": "tiny", "warmup": 0, "repeats": 2, "memory_pairs": 1}

    def __post_init__(self) -> None:
        self.at_least(threads=1, warmup=0, repeats=1, memory_pairs=1)


def run_config(model: str, layout: str) -> Config:
    # One gradient bucket: the benchmark fills the engine's flat gradient buffer directly.
    return load_config(None, [f"model.preset={model}", f"method.preset={PRESET.format(layout=layout)}",
                              f"train.steps={TOTAL_STEPS}", "engine.num_buckets=1"])


def build_engine(cfg: Config, seed: int) -> tuple[MatrixEngine, dict[str, torch.nn.Module]]:
    """The backbone of `build_model` and its engine, built by the trainer's `build_matrix_engine` (fp32 masters from
    the fp32 model); W = 1 without a process group."""
    backbone = backbone_modules(build_model(cfg.model, cfg.method, VOCAB, seed))
    initial = {name: backbone_param(m).detach().float().clone() for name, m in backbone.items()}
    return build_matrix_engine(cfg, backbone, None, initial=initial, device=torch.device("cpu")), backbone


def time_refresh(engine: MatrixEngine, policy: TopologyPolicy, lr: float, warmup: int, repeats: int
                 ) -> dict[str, Any]:
    """Paired rounds: (refresh step, untimed step, timed TANS step), reversed to (timed TANS step, refresh step,
    untimed step) every other round. Returns the median ratio, median and per-round seconds, and the summed
    statistics of the last refresh."""
    refresh = policy.refresh_fn(REFRESH_STEP)

    def plain() -> float:
        t0 = time.perf_counter()
        engine.step(lr)
        return time.perf_counter() - t0

    def refreshed() -> tuple[float, float, dict[str, dict]]:
        t0 = time.perf_counter()
        stats = engine.step(lr, refresh=refresh)
        return time.perf_counter() - t0, engine.last_refresh_seconds, stats

    for _ in range(WARM_TANS_STEPS):
        engine.step(lr)
    rounds: dict[str, list[float]] = {"ratio": [], "tans_step": [], "refresh": [], "step_with_refresh": []}
    for i in range(warmup + repeats):
        if i % 2 == 0:
            total, seconds, stats = refreshed()
            plain()                              # tau = 0 after a refresh: no Newton-Schulz, so untimed
            step = plain()
        else:
            step = plain()
            total, seconds, stats = refreshed()
            plain()
        if i >= warmup:
            for key, value in zip(rounds, (seconds / step, step, seconds, total)):
                rounds[key].append(value)
    first = next(iter(stats.values()))
    return {
        "ratio": statistics.median(rounds["ratio"]),
        "seconds": {**{key: statistics.median(v) for key, v in rounds.items() if key != "ratio"}, "rounds": rounds},
        "stats": {"zeta": first["zeta"], "temperature": first["temperature"],
                  **{key: sum(s[key] for s in stats.values()) for key in STAT_KEYS}},
    }


def time_scores_only(backbone: dict[str, torch.nn.Module], params: RefreshParams) -> float:
    """One pass of ch_scores over every matrix's current mask: the score share of a refresh, measured once."""
    total = 0.0
    for module in backbone.values():
        mask = decode(module.meta)
        t0 = time.perf_counter()
        ch_scores(mask, params.score, params.chunk_size)
        total += time.perf_counter() - t0
    return total


def score_peak(shape: tuple[int, int], chunk: int, threads: int, pairs: int) -> dict[str, Any]:
    """Peak RSS of `pairs` pairs of fresh processes (scores, idle baseline) and the median extra: the default
    allocator's peak varies by a few tenths of the dense size from run to run (glibc keeps freed heap resident)."""
    peaks = fresh_peaks(_SCORE_CHILD, [[*map(str, (*shape, chunk, threads, c))] for _ in range(pairs) for c in (1, 0)],
                        threads)
    scores, idle = peaks[0::2], peaks[1::2]
    extra = [a - b for a, b in zip(scores, idle)]
    return {"scores_peak_rss": scores, "idle_peak_rss": idle, "extra": extra,
            "extra_median": statistics.median(extra), "dense_fp32": shape[0] * shape[1] * 4}


def shape_counts(backbone: dict[str, torch.nn.Module]) -> dict[str, int]:
    """Projection:OxI -> number of matrices."""
    counts = Counter(f"{name.rsplit('.', 1)[-1]}:{m.out_features}x{m.in_features}" for name, m in backbone.items())
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    s, json_path = parse(TopologySettings, argv, __doc__.split("\n\n")[0])
    torch.set_num_threads(s.threads)
    score_shape = QUICK_SCORE_SHAPE if s.quick else SCORE_SHAPE
    chunk = RefreshParams().chunk_size
    # The memory processes overlap the model builds (untimed) and are collected before any timing starts.
    with ThreadPoolExecutor(1) as pool:
        peaks = pool.submit(score_peak, score_shape, chunk, s.threads, s.memory_pairs)
        built = {layout: (cfg, *build_engine(cfg, s.seed))
                 for layout, cfg in ((lay, run_config(s.model, lay)) for lay in LAYOUTS)}
        memory = peaks.result()

    ratios, seconds, stats, layouts, log = {}, {}, {}, {}, progress("bench.topology")
    for layout, (cfg, engine, backbone) in built.items():
        engine.grad_buffer.normal_(generator=torch.Generator().manual_seed(s.seed))
        policy = TopologyPolicy(cfg.method.topology, TOTAL_STEPS, s.seed)
        assert policy.due(REFRESH_STEP), (cfg.method.topology, REFRESH_STEP)
        result = time_refresh(engine, policy, cfg.method.lr, s.warmup, s.repeats)
        ratios[layout], seconds[layout], stats[layout] = result["ratio"], result["seconds"], result["stats"]
        seconds[layout]["scores_only"] = time_scores_only(backbone, policy.params)
        layouts[layout] = {"preset": cfg.method.preset, "rule": cfg.method.rule, "lr": cfg.method.lr,
                           "tans": dataclasses.asdict(engine.hp), "refresh": dataclasses.asdict(policy.params),
                           "update_interval": cfg.method.topology.update_interval, "t_end": policy.t_end,
                           "matrices": shape_counts(backbone)}
        log(f"{layout} refresh/tans {ratios[layout]:.3f}")

    config = {
        "quick": s.quick, "model": s.model, "vocab": VOCAB, "sparsity": "1:4", "threads": s.threads,
        "world_size": 1, "total_steps": TOTAL_STEPS, "refresh_step": REFRESH_STEP,
        "warm_tans_steps": WARM_TANS_STEPS, "warmup": s.warmup, "repeats": s.repeats, "seed": s.seed,
        "layouts": layouts,
        "statistic": "median over rounds of engine.last_refresh_seconds / plain engine.step seconds; rounds "
                     "alternate (refresh, untimed, timed) and (timed, refresh, untimed)",
        "score_shape": list(score_shape), "score_variant": "ch2", "score_chunk_size": chunk,
        "memory_pairs": s.memory_pairs,
        "score_memory": "median over pairs of peak RSS (VmHWM) of a fresh process (mask + ch_scores) minus that "
                        "of a fresh idle one (mask only)",
        "targets": {"refresh_over_tans_step": TARGET_REFRESH, "score_peak_bytes_over_dense_fp32": TARGET_SCORE_PEAK},
    }
    figures = [Figure("refresh_over_tans_step", ratios, TARGET_REFRESH),
               Figure("score_peak_bytes_over_dense_fp32", memory["extra_median"] / memory["dense_fp32"],
                      TARGET_SCORE_PEAK)]
    head = (f"{s.model} 1:4 backbone, {s.threads} thread(s), W = 1, step {REFRESH_STEP} of {TOTAL_STEPS}, "
            f"{s.repeats} paired rounds; scores of a {score_shape[0]} x {score_shape[1]} mask, chunk {chunk}")
    table = [[lay, seconds[lay]["tans_step"], seconds[lay]["refresh"], seconds[lay]["scores_only"],
              int(stats[lay]["groups_selected"]), int(stats[lay]["groups_changed"])] for lay in LAYOUTS]
    return finish(json_path, figures, {"seconds": seconds, "score_memory_bytes": memory, "refresh_stats": stats},
                  config, [(["layout", "TANS step s", "refresh s", "scores only s", "groups selected",
                             "groups changed"], table)], head)


if __name__ == "__main__":
    main()
