"""An H200 estimate of the training step from op traces recorded here (issue 25 item 5): tokens/s of CHTs 1:4 + TANS
over dense AdamW and the backbone optimizer's share of the step, at 350m and 1b, on 1 and on 8 ranks.

Rows (equal tokens per step, so a step-time ratio is a tokens/s ratio):
  dense AdamW      method.preset=dense_adamw as a dense user runs it: every parameter (projections included) in
                   DeepSpeed ZeRO-2's fused AdamW, no matrix engine
  CHTs 1:4 + TANS  chtsnm_nobranch_1of4_row (bench_train's CHTs 1:4 + TANS row): backbone in the matrix engine, the
                   rest in ZeRO-2's AdamW, one topology refresh every update_interval steps amortized over it
Run shape: the paper experiment of the size (configs/experiments/paper_<size>_chtsnm_1of4_row.yaml: micro-batch,
grad_accum, seq_len 256, vocab 32000, grad_clip 0), the same per-rank batch on 1 and on 8 ranks.

How (distsparse/perf/step_trace.py): each rank's steady step is traced on the meta device at the full preset size
(no layer extrapolation), multi-rank layouts from the engine's own code for rank r of W (`simulated_world`): every
rank of 8 is traced and the slowest rank's step is the step. The refresh phase is traced on the CPU at 1, 2 and 4
layers of the preset's widths and extrapolated linearly in the matrices a rank refreshes (fit on 2 and 4 layers;
`refresh_linearity_rel_err`: the 1-and-2-layer fit's error at 4 layers). distsparse/perf/roofline.py turns each
trace into seconds. `est_h200_tans_share`: the backbone step (the engine's steady-step ops and its value gather)
plus the amortized refresh, over the CHTs step; the backbone gradients' reduce-scatter, which the dense row pays
through DeepSpeed too, is in the backward.

    python tools/estimate_h200.py --json docs/results/estimate_h200.json
    python tools/estimate_h200.py --before-json before.json --json docs/results/estimate_h200.json
The "before" figures (the code before issue 25, 3a33929: per-matrix engine, the index-rebuilding sparse layer) come
from this tool run against a worktree of that commit with the tracer copied in, from outside the checkout (the
working directory comes first on sys.path):
    git worktree add /tmp/before_wt 3a33929 && mkdir -p /tmp/before_wt/distsparse/perf
    cp distsparse/op_count.py /tmp/before_wt/distsparse/ && cp distsparse/perf/*.py /tmp/before_wt/distsparse/perf/
    cd /tmp && PYTHONPATH=/tmp/before_wt python $REPO/tools/estimate_h200.py --json before.json
    python tools/estimate_h200.py --quick --json out.json      # tiny model, W 1 and 2 (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import add_json_arg, machine_info, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]

DENSE, SPARSE = "dense_adamw", "chtsnm_nobranch_1of4_row"
ROWS = {DENSE: "dense AdamW", SPARSE: "CHTs 1:4 + TANS"}
RATIO_KEY, SHARE_KEY = "est_h200_chts_1of4_tans_over_dense_adamw", "est_h200_tans_share"
TARGETS = {RATIO_KEY: {"350m": {"8": 0.90, "1": 0.85}}, SHARE_KEY: {"8": 0.05}}
REFRESH_LAYERS = (1, 2, 4)
PAPER_GRAD_ACCUM = 2   # configs/experiments/paper_{350m,1b}_*: 512 = micro_batch x 2 x their documented ranks
QUICK = {"model": "tiny", "overrides": ["train.micro_batch=2", "train.grad_accum=2", "data.seq_len=32",
                                        "model.vocab_size=512", "train.steps=1000"], "world_sizes": (1, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_arg(p)
    p.add_argument("--models", default="350m,1b", help="comma-separated sizes with a paper experiment (default 350m,1b)")
    p.add_argument("--world-sizes", default="1,8", help="comma-separated rank counts (default 1,8)")
    p.add_argument("--before-json", default=None,
                   help="this tool's JSON from the code before issue 25: its figures are kept under 'before'")
    p.add_argument("--quick", action="store_true", help="tiny model, micro-batch 2 x 32, W 1 and 2 (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.world_sizes = [QUICK["model"]], list(QUICK["world_sizes"])
        return args
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    known = sorted(q.stem.split("_")[1] for q in (ROOT / "configs/experiments").glob("paper_*_chtsnm_1of4_row.yaml"))
    bad = [m for m in args.models if m not in known]
    if bad or not args.models:
        p.error(f"--models: got {','.join(args.models)!r}; allowed: a comma-separated subset of {', '.join(known)}")
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    except ValueError:
        args.world_sizes = []
    if not args.world_sizes or min(args.world_sizes) < 1:
        p.error(f"--world-sizes: got {args.world_sizes!r}; allowed: comma-separated integers >= 1")
    return args


def run_config(model: str, method: str, quick: bool):
    from distsparse.config import load_config

    if quick:
        return load_config(None, [f"model.preset={model}", f"method.preset={method}", *QUICK["overrides"]])
    # The same per-rank batch on 1 and on 8 ranks (module docstring): the experiment's micro-batch and the
    # accumulation its global batch has at its documented world size (2: 8 GPUs at 350m, 16 at 1b), pinned, where
    # train.global_batch_size would derive 16-32 on one rank.
    return load_config(str(ROOT / f"configs/experiments/paper_{model}_chtsnm_1of4_row.yaml"),
                       [f"method.preset={method}", "train.global_batch_size=0", f"train.grad_accum={PAPER_GRAD_ACCUM}"])


def seconds(trace, world_size: int) -> dict[str, float]:
    from distsparse.perf.roofline import estimate
    return estimate(trace.ops, trace.collectives, world_size)


def refresh_model(cfg, log) -> dict[str, Any]:
    """Refresh seconds = intercept + per_matrix x matrices refreshed (module docstring), with the linearity check."""
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


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """The two headline keys as {model: {world_size: value}}."""
    return {key: {m: {w: r[key] for w, r in res["by_world_size"].items()} for m, res in results.items()}
            for key in (RATIO_KEY, SHARE_KEY)}


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
    import subprocess

    import distsparse

    tree = Path(distsparse.__file__).resolve().parents[1]
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"distsparse_tree": str(tree), "commit": proc.stdout.strip() or None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from distsparse.perf import roofline

    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"estimate_h200: [{time.perf_counter() - start:.0f}s] {msg}", file=sys.stderr, flush=True)

    results = {m: estimate_model(m, args.world_sizes, args.quick, log) for m in args.models}
    payload: dict[str, Any] = {**figures(results), "targets": TARGETS, "results": results, "model": {
        "docstring": roofline.__doc__, "launch_floor_s": roofline.LAUNCH_FLOOR_S,
        "bf16_peak_flops": roofline.BF16_PEAK_FLOPS, "fp32_peak_flops": roofline.FP32_PEAK_FLOPS,
        "hbm_bytes_per_s": roofline.HBM_BPS, "nvlink_bytes_per_s": roofline.NVLINK_BPS,
        "inter_node_bytes_per_s": roofline.INTER_NODE_BPS, "gpus_per_node": roofline.GPUS_PER_NODE},
        "rows": ROWS, "method": __doc__, "quick": args.quick, "code": code_version(), "machine": machine_info()}
    if args.before_json:
        before = json.loads(Path(args.before_json).read_text())
        payload["before"] = {k: before[k] for k in (RATIO_KEY, SHARE_KEY)}
        payload["before"]["code"] = before.get("code")
        payload["before"]["results"] = before["results"]
    if args.json:
        write_json(args.json, payload)
    headers = ["model", "ranks", "dense fwd+bwd ms", "dense step ms", "dense total ms", "CHTs fwd+bwd ms",
               "TANS+refresh ms", "CHTs dense ms", "CHTs total ms", "tokens/s ratio", "TANS share"]
    print_table(headers, table(results))
    for m, res in results.items():
        print(f"{m}: refresh extrapolation linearity error {res['refresh']['refresh_linearity_rel_err']:.2%}")
    return payload


if __name__ == "__main__":
    main()
