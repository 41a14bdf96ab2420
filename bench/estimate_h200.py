"""An H200 estimate of the training step from op traces recorded here (issue 25 item 5): tokens/s of CHTs 1:4 + TANS
over dense AdamW and the backbone optimizer's share of the step, at 350m and 1b, on 1 and on 8 ranks. Each rank's
steady step is traced on the meta device at the full preset size (distsparse/perf/step_trace.py) and
distsparse/perf/roofline.py turns each trace into seconds; the rows, the refresh extrapolation and how the "before"
figures were made: docs/benchmarks.md.

    python -m bench.estimate_h200 --json docs/results/estimate_h200.json
    python -m bench.estimate_h200 before_json=before.json --json docs/results/estimate_h200.json
    python -m bench.estimate_h200 --quick --json out.json      # tiny model, W 1 and 2 (the test suite's smoke run)
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core import Figure, Settings, finish, parse, progress

ROOT = Path(__file__).resolve().parents[1]
DENSE, SPARSE = "dense_adamw", "chtsnm_nobranch_1of4_row"
ROWS = {DENSE: "dense AdamW", SPARSE: "CHTs 1:4 + TANS"}
RATIO_KEY, SHARE_KEY = "est_h200_chts_1of4_tans_over_dense_adamw", "est_h200_tans_share"
TARGETS = {RATIO_KEY: {"350m": {"8": 0.90, "1": 0.85}}, SHARE_KEY: {"8": 0.05}}
REFRESH_LAYERS = (1, 2, 4)
PAPER_GRAD_ACCUM = 2   # configs/experiments/paper_{350m,1b}_*: 512 = micro_batch x 2 x their documented ranks
QUICK_OVERRIDES = ["train.micro_batch=2", "train.grad_accum=2", "data.seq_len=32", "model.vocab_size=512",
                   "train.steps=1000"]


@dataclass
class EstimateSettings(Settings):
    models: str = "350m,1b"       # comma-separated sizes with a paper experiment
    world_sizes: str = "1,8"      # comma-separated rank counts
    before_json: str = ""         # this tool's JSON from the code before issue 25: kept under 'before'
    QUICK = {"models": "tiny", "world_sizes": "1,2"}

    def __post_init__(self) -> None:
        if self.quick:
            return
        papers = (ROOT / "configs/experiments").glob("paper_*_chtsnm_1of4_row.yaml")
        known = sorted(q.stem.split("_")[1] for q in papers)
        if not self.model_list or any(m not in known for m in self.model_list):
            raise ValueError(f"models: got {self.models!r}; allowed: a comma-separated subset of {', '.join(known)}")
        try:
            sizes = [int(w) for w in self.world_sizes.split(",") if w.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise ValueError(f"world_sizes: got {self.world_sizes!r}; allowed: comma-separated integers >= 1")

    @property
    def model_list(self) -> list[str]:
        return [m.strip() for m in self.models.split(",") if m.strip()]

    @property
    def world_size_list(self) -> list[int]:
        return [int(w) for w in self.world_sizes.split(",") if w.strip()]


def run_config(model: str, method: str, quick: bool):
    from distsparse.config import load_config

    if quick:
        return load_config(None, [f"model.preset={model}", f"method.preset={method}", *QUICK_OVERRIDES])
    # The same per-rank batch on 1 and on 8 ranks: the experiment's micro-batch and the accumulation its global batch
    # has at its documented world size (2: 8 GPUs at 350m, 16 at 1b), pinned, where train.global_batch_size would
    # derive 16-32 on one rank.
    return load_config(str(ROOT / f"configs/experiments/paper_{model}_chtsnm_1of4_row.yaml"),
                       [f"method.preset={method}", "train.global_batch_size=0", f"train.grad_accum={PAPER_GRAD_ACCUM}"])


def seconds(trace, world_size: int) -> dict[str, float]:
    from distsparse.perf.roofline import estimate
    return estimate(trace.ops, trace.collectives, world_size)


def refresh_model(cfg, log) -> dict[str, Any]:
    """Refresh seconds = intercept + per_matrix x matrices refreshed, fit on 2 and 4 layers, with the linearity
    check (the 1-and-2-layer fit's error at 4 layers)."""
    from distsparse.perf.step_trace import refresh_trace
    from distsparse.train.topology_policy import TopologyPolicy

    topo = cfg.method.topology
    t_end = TopologyPolicy(topo, cfg.train.steps, cfg.train.seed).t_end
    step = max(topo.update_interval, round(t_end / 2 / topo.update_interval) * topo.update_interval)
    points = {}
    for layers in REFRESH_LAYERS:
        log(f"refresh trace on the CPU: {layers} layers, step {step}")
        trace, n = refresh_trace(cfg, layers, step)
        points[layers] = (n, seconds(trace, 1)["total_s"], trace.ops)

    def fit(a: int, b: int) -> tuple[float, float]:
        (na, sa, _), (nb, sb, _) = points[a], points[b]
        per = (sb - sa) / (nb - na)
        return sa - per * na, per
    intercept, per_matrix = fit(2, 4)
    i12, p12 = fit(1, 2)
    n4, s4, _ = points[4]
    return {"step": step, "update_interval": topo.update_interval, "intercept_s": intercept,
            "per_matrix_s": per_matrix, "points": {str(k): {"matrices": v[0], "est_s": v[1], "ops": len(v[2])}
                                                  for k, v in points.items()},
            "refresh_linearity_rel_err": abs(i12 + p12 * n4 - s4) / s4}


def estimate_model(model: str, world_sizes: list[int], quick: bool, log) -> dict[str, Any]:
    """Every row of one size at every world size: phase seconds per rank, the slowest rank's, the figures."""
    from distsparse.perf.roofline import collective_seconds
    from distsparse.perf.step_trace import rank_traces

    dense_cfg, sparse_cfg = run_config(model, DENSE, quick), run_config(model, SPARSE, quick)
    vocab = dense_cfg.model.vocab_size
    refresh = refresh_model(sparse_cfg, log)
    out: dict[str, Any] = {"refresh": refresh, "run": {
        "micro_batch": dense_cfg.train.micro_batch, "grad_accum": dense_cfg.train.grad_accum,
        "seq_len": dense_cfg.data.seq_len, "vocab_size": vocab, "layers": dense_cfg.model.num_hidden_layers,
        "hidden_size": dense_cfg.model.hidden_size}, "by_world_size": {}}
    for w in world_sizes:
        log(f"{model}, {w} ranks: {DENSE} (rank 0; every rank is the same)")
        d = rank_traces(dense_cfg, vocab, w, 0, sparse=False)
        dense_phases = {k: seconds(d[k], w) for k in ("forward_backward", "dense_step")}
        dense_s = sum(p["total_s"] for p in dense_phases.values())
        ranks = []
        for r in range(w):
            log(f"{model}, {w} ranks: {SPARSE} rank {r}")
            t = rank_traces(sparse_cfg, vocab, w, r, sparse=True)
            phases = {k: seconds(t[k], w) for k in ("forward_backward", "backbone_step", "joint_scalars", "dense_step")}
            refresh_s = (refresh["intercept_s"] + refresh["per_matrix_s"] * t["owned_sparse"]
                         + collective_seconds(t["codes_gather"], w))
            amortized = refresh_s / refresh["update_interval"]
            step_s = sum(p["total_s"] for p in phases.values()) + amortized
            ranks.append({"phases": phases, "refresh_step_extra_s": refresh_s, "refresh_amortized_s": amortized,
                          "owned_sparse_matrices": t["owned_sparse"], "step_s": step_s,
                          "backbone_s": phases["backbone_step"]["total_s"] + amortized})
        slow = max(ranks, key=lambda rk: rk["step_s"])
        out["by_world_size"][str(w)] = {
            RATIO_KEY: dense_s / slow["step_s"], SHARE_KEY: slow["backbone_s"] / slow["step_s"],
            "dense_adamw_step_s": dense_s, "chts_step_s": slow["step_s"],
            "dense_adamw_tokens_per_s": w * out["run"]["micro_batch"] * out["run"]["grad_accum"]
            * out["run"]["seq_len"] / dense_s,
            "rows": {DENSE: {"phases": dense_phases, "step_s": dense_s},
                     SPARSE: {"slowest_rank": ranks.index(slow), "ranks": ranks}}}
    return out


def table(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for m, res in results.items():
        for w, r in res["by_world_size"].items():
            dense = r["rows"][DENSE]["phases"]
            sparse = r["rows"][SPARSE]["ranks"][r["rows"][SPARSE]["slowest_rank"]]
            rows.append([m, w, dense["forward_backward"]["total_s"] * 1e3, dense["dense_step"]["total_s"] * 1e3,
                         r["dense_adamw_step_s"] * 1e3, sparse["phases"]["forward_backward"]["total_s"] * 1e3,
                         sparse["backbone_s"] * 1e3, sparse["phases"]["dense_step"]["total_s"] * 1e3,
                         r["chts_step_s"] * 1e3, r[RATIO_KEY], r[SHARE_KEY]])
    return rows


def code_version() -> dict[str, str | None]:
    """Which distsparse tree was traced (a PYTHONPATH worktree for the "before" figures) and its commit."""
    import distsparse

    tree = Path(distsparse.__file__).resolve().parents[1]
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"distsparse_tree": str(tree), "commit": proc.stdout.strip() or None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    s, json_path = parse(EstimateSettings, argv, __doc__.split("\n\n")[0])
    from distsparse.perf import roofline

    log = progress("bench.estimate_h200")
    results = {m: estimate_model(m, s.world_size_list, s.quick, log) for m in s.model_list}
    values = {key: {m: {w: r[key] for w, r in res["by_world_size"].items()} for m, res in results.items()}
              for key in (RATIO_KEY, SHARE_KEY)}
    rest: dict[str, Any] = {"targets": TARGETS, "results": results, "model": {
        "docstring": roofline.__doc__, "launch_floor_s": roofline.LAUNCH_FLOOR_S,
        "bf16_peak_flops": roofline.BF16_PEAK_FLOPS, "fp32_peak_flops": roofline.FP32_PEAK_FLOPS,
        "hbm_bytes_per_s": roofline.HBM_BPS, "nvlink_bytes_per_s": roofline.NVLINK_BPS,
        "inter_node_bytes_per_s": roofline.INTER_NODE_BPS, "gpus_per_node": roofline.GPUS_PER_NODE},
        "rows": ROWS, "method": __doc__, "quick": s.quick, "code": code_version()}
    if s.before_json:
        before = json.loads(Path(s.before_json).read_text())
        rest["before"] = {**{k: before[k] for k in (RATIO_KEY, SHARE_KEY)}, "code": before.get("code"),
                          "results": before["results"]}
    # Judged cells: 350m's tokens/s ratio at 8 and 1 ranks, every size's share at 8 ranks.
    share_targets = {m: TARGETS[SHARE_KEY] for m in values[SHARE_KEY]}
    figures = [Figure(RATIO_KEY, values[RATIO_KEY], TARGETS[RATIO_KEY], ">="),
               Figure(SHARE_KEY, values[SHARE_KEY], share_targets)]
    headers = ["model", "ranks", "dense fwd+bwd ms", "dense step ms", "dense total ms", "CHTs fwd+bwd ms",
               "TANS+refresh ms", "CHTs dense ms", "CHTs total ms", "tokens/s ratio", "TANS share"]
    return finish(json_path, figures, rest, None, [(headers, table(results))],
                  "; ".join(f"{m}: refresh extrapolation linearity error "
                            f"{res['refresh']['refresh_linearity_rel_err']:.2%}" for m, res in results.items()))


if __name__ == "__main__":
    main()
