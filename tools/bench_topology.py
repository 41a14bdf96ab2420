"""Benchmark of the CHTs topology refresh (issue 5): refresh cost against a TANS step, and score memory.

1. `refresh_over_tans_step`: one full refresh of every matrix of a `60m` 1:4 backbone (CH2-L3n scores,
   soft-magnitude selection, regrowth with MPR, slot map, state move, installing the new codes) over one TANS
   optimizer step of the same backbone, row-wise and block-wise. The backbone comes from `build_model` with the
   `chtsnm_nobranch_1of4_{row,block}` preset (vocab 32000), the step from a `MatrixEngine` with one process
   (W = 1: the codes all-gather, O*I/16 bytes of uint8 per matrix, is then a local copy) and the refresh from
   `TopologyPolicy.refresh_fn`, exactly as the trainer calls them, at step 100 of 10000 after a few TANS
   steps. The refresh time is the engine's `last_refresh_seconds`; the TANS step is a plain `engine.step(lr)`.
   Rounds are paired and alternate their order; the figure is the median of per-round ratios (tools/benchlib).
   A refresh resets the matrix age tau to 0 and the first step after it skips Newton-Schulz (gamma = 0), so
   every round runs one untimed step after its refresh: each timed TANS step runs Newton-Schulz.
   Target <= 2.0: at the default interval of 100 steps a refresh then costs under 2% of the optimizer's time.
   `scores_only` times `ch_scores` alone on every matrix once: the share of the refresh that the score GEMMs
   take (2 O I (O + I) multiply-adds per matrix, against 5 (2 m^2 n + m^3) for Newton-Schulz).
2. `score_peak_bytes_over_dense_fp32`: peak extra memory of `ch_scores` (default variant and chunk size) on a
   5464 x 2048 row-wise 1:4 mask (a 1B FFN matrix), over the bytes of its dense fp32 matrix. Peak memory is
   DESIGN s6's: the peak RSS of a fresh subprocess that builds the mask and computes the scores, minus that of an
   idle fresh subprocess that only builds the mask (read as VmHWM, see _SCORE_CHILD). Target <= 4
   (research/cht_topology.md s6).

One CPU thread by default, as each of 2 ranks on 2 cores gets in training; `--threads` measures others.

    python tools/bench_topology.py --json out.json
    python tools/bench_topology.py --quick --json out.json     # tiny shapes, for the test suite
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchlib import add_json_arg, machine_info, print_table, write_json
from distsparse.config import Config, load_config
from distsparse.models import backbone_modules, backbone_param, build_model
from distsparse.nm import decode
from distsparse.optim.engine import MatrixEngine
from distsparse.topology import RefreshParams, ch_scores
from distsparse.train.topology_policy import TopologyPolicy
from distsparse.train.trainer import build_matrix_engine

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ("row", "block")
PRESET = "chtsnm_nobranch_1of4_{layout}"
VOCAB = 32000
TOTAL_STEPS, REFRESH_STEP = 10000, 100
WARM_TANS_STEPS = 3          # TANS state (V, P, tau) after a few steps, not the all-zero start
SCORE_SHAPE, QUICK_SCORE_SHAPE = (5464, 2048), (64, 32)
TARGET_REFRESH, TARGET_SCORE_PEAK = 2.0, 4.0
STAT_KEYS = ("groups_selected", "groups_changed", "mpr_exclusions", "links_changed")

# Runs in a fresh interpreter: argv = out, in, chunk, threads, compute (0 = the idle baseline); prints the peak
# RSS in bytes. The peak is VmHWM, the high-water mark of this process's own memory image, not ru_maxrss: Linux
# carries ru_maxrss across fork and exec, so a child's ru_maxrss is at least its parent's RSS at the fork (the
# benchmark's ~0.4 GB), which hid the whole score peak in both children. The mask is built from a uint8 draw
# so that its construction frees no large transient that ch_scores could reuse without raising the peak; both
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
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")))   # kB
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_json_arg(p)
    p.add_argument("--quick", action="store_true", help="tiny model and score shape, few rounds (smoke test)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: one rank's share)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 1; 0 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 6; 2 with --quick)")
    p.add_argument("--memory-pairs", type=int, default=None,
                   help="(scores, idle) process pairs for the score peak, median taken (default 3; 1 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads: got {args.threads}; allowed: an integer >= 1")
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 6)
    args.memory_pairs = args.memory_pairs if args.memory_pairs is not None else (1 if args.quick else 3)
    if args.warmup < 0 or args.repeats < 1 or args.memory_pairs < 1:
        p.error(f"--warmup/--repeats/--memory-pairs: got {args.warmup}/{args.repeats}/{args.memory_pairs}; "
                f"allowed: >= 0, >= 1, >= 1")
    return args


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


def start_score_peak(shape: tuple[int, int], chunk: int, threads: int, pairs: int
                     ) -> list[tuple[subprocess.Popen, subprocess.Popen]]:
    """Start `pairs` pairs of fresh processes (scores, idle baseline). RSS is per process, so they may run
    together; the peak of the default allocator varies by a few tenths of the dense size from run to run
    (glibc keeps freed heap chunks resident), so the figure is the median over pairs."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads))

    def start(compute: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _SCORE_CHILD, *map(str, (*shape, chunk, threads, compute))],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    return [(start(1), start(0)) for _ in range(pairs)]


def _peak(proc: subprocess.Popen) -> int:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"score peak subprocess {proc.args[-5:]} failed with exit code {proc.returncode}:\n{err}")
    return int(out.split()[-1])


def finish_score_peak(procs: list[tuple[subprocess.Popen, subprocess.Popen]], shape: tuple[int, int]
                      ) -> dict[str, Any]:
    """Peak bytes per pair and the median extra (scores minus idle) over the pairs."""
    scores, idle = zip(*((_peak(a), _peak(b)) for a, b in procs))
    extra = [s - i for s, i in zip(scores, idle)]
    return {"scores_peak_rss": list(scores), "idle_peak_rss": list(idle), "extra": extra,
            "extra_median": statistics.median(extra), "dense_fp32": shape[0] * shape[1] * 4}


def shape_counts(backbone: dict[str, torch.nn.Module]) -> dict[str, int]:
    """Projection:OxI -> number of matrices."""
    counts = Counter(f"{name.rsplit('.', 1)[-1]}:{m.out_features}x{m.in_features}" for name, m in backbone.items())
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = "tiny" if args.quick else "60m"
    score_shape = QUICK_SCORE_SHAPE if args.quick else SCORE_SHAPE
    chunk = RefreshParams().chunk_size
    # The memory processes overlap the model builds (untimed) and are collected before any timing starts.
    procs = start_score_peak(score_shape, chunk, args.threads, args.memory_pairs)
    configs = {layout: run_config(model, layout) for layout in LAYOUTS}
    built = {layout: (cfg, *build_engine(cfg, args.seed)) for layout, cfg in configs.items()}
    memory = finish_score_peak(procs, score_shape)
    score_ratio = memory["extra_median"] / memory["dense_fp32"]

    ratios, seconds, stats, layouts = {}, {}, {}, {}
    for layout, (cfg, engine, backbone) in built.items():
        engine.grad_buffer.normal_(generator=torch.Generator().manual_seed(args.seed))
        policy = TopologyPolicy(cfg.method.topology, TOTAL_STEPS, args.seed)
        assert policy.due(REFRESH_STEP), (cfg.method.topology, REFRESH_STEP)
        result = time_refresh(engine, policy, cfg.method.lr, args.warmup, args.repeats)
        ratios[layout], seconds[layout], stats[layout] = result["ratio"], result["seconds"], result["stats"]
        seconds[layout]["scores_only"] = time_scores_only(backbone, policy.params)
        layouts[layout] = {"preset": cfg.method.preset, "rule": cfg.method.rule, "lr": cfg.method.lr,
                           "tans": dataclasses.asdict(engine.hp), "refresh": dataclasses.asdict(policy.params),
                           "update_interval": cfg.method.topology.update_interval, "t_end": policy.t_end,
                           "matrices": shape_counts(backbone)}
        print(f"bench_topology: {layout} refresh/tans {ratios[layout]:.3f}", file=sys.stderr, flush=True)

    config = {
        "quick": args.quick, "model": model, "vocab": VOCAB, "sparsity": "1:4", "threads": args.threads,
        "world_size": 1, "total_steps": TOTAL_STEPS, "refresh_step": REFRESH_STEP,
        "warm_tans_steps": WARM_TANS_STEPS, "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
        "layouts": layouts,
        "statistic": "median over rounds of engine.last_refresh_seconds / plain engine.step seconds; rounds "
                     "alternate (refresh, untimed, timed) and (timed, refresh, untimed)",
        "score_shape": list(score_shape), "score_variant": "ch2", "score_chunk_size": chunk,
        "memory_pairs": args.memory_pairs,
        "score_memory": "median over pairs of peak RSS (VmHWM) of a fresh process (mask + ch_scores) minus that "
                        "of a fresh idle one (mask only)",
        "targets": {"refresh_over_tans_step": TARGET_REFRESH, "score_peak_bytes_over_dense_fp32": TARGET_SCORE_PEAK},
    }
    payload = {"refresh_over_tans_step": ratios, "score_peak_bytes_over_dense_fp32": score_ratio,
               "machine": machine_info(), "config": config, "seconds": seconds, "score_memory_bytes": memory,
               "refresh_stats": stats}
    if args.json:
        write_json(args.json, payload)

    print(f"\n{model} 1:4 backbone, {args.threads} thread(s), W = 1, step {REFRESH_STEP} of {TOTAL_STEPS}, "
          f"{args.repeats} paired rounds; scores of a {score_shape[0]} x {score_shape[1]} mask, chunk {chunk}")
    print_table(["layout", "TANS step s", "refresh s", "scores only s", "groups selected", "groups changed"],
                [[lay, seconds[lay]["tans_step"], seconds[lay]["refresh"], seconds[lay]["scores_only"],
                  int(stats[lay]["groups_selected"]), int(stats[lay]["groups_changed"])] for lay in LAYOUTS])
    print()
    figures = [[f"refresh_over_tans_step/{lay}", ratios[lay], TARGET_REFRESH] for lay in LAYOUTS]
    figures.append(["score_peak_bytes_over_dense_fp32", score_ratio, TARGET_SCORE_PEAK])
    print_table(["figure", "value", "target <=", "verdict"],
                [[name, value, target, "met" if value <= target else "MISSED"] for name, value, target in figures])
    return payload


if __name__ == "__main__":
    main()
