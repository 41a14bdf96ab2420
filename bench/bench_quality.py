"""Quality benchmark (issue 6 item 4): train several methods on the same text, rank them by validation PPL.

    python -m bench.bench_quality --data data/pydocs4k --methods dense_adamw,chts24_1of4_row,chtsnm_1of4_row \\
        --model small_tied --steps 1500 --json runs/quality/quality.json --plot runs/quality/quality.png \\
        [--lr-sweep chtsnm_1of4_row [--lr-scales 0.5,1,2] [--dense-lr-scales 1,2,4] [--branch-lr-scales 0.5,1,2]
         [--sweep-steps 1500]] \\
        [--force] [--nproc 1] [--eval-points 10] [--out-root runs/quality]

Every method is one run (bench/quality_runs.py) with the same model, seed, data order and token budget: the global
batch (--micro-batch sequences of --seq-len tokens, split over the ranks) and the step count are shared, so the
sampler hands every method the same samples in the same order. Validation PPL (token-weighted, the trainer's
`loss/val_ppl`) is evaluated every steps // K steps and at the last step, at the same token counts for every
method; the curve is read back from the run's curves.csv, the final numbers from its result.json. The table ranks
the methods by final PPL, with the ratio to `dense_adamw` and to the CHTs24 run of the same sparsity and layout.

Resumable: the JSON is rewritten atomically after every method; a method with a result there is skipped unless
--force (a JSON of another comparison config is refused); a failed method is recorded with "skipped": reason and
retried by the next invocation; a finished run directory of the same config is read back, one of another config
refused before anything trains (except the full run after a short sweep, whose rates are known only then). The
DeepSpeed JSON is no part of a run's config: give runs under another --ds-config their own --out-root.

LR sweep (--lr-sweep): every --lr-scales factor of the preset's backbone `method.lr` with every --dense-lr-scales
factor of its dense-side `train.lr` (embeddings, norms, head, branches), swept independently so that how well the
dense side is tuned does not decide a comparison of backbones; then the full run at the best pair. Short sweeps
(default 1/4 of the steps, the LR schedule compressed to it) are cheap but favour high LRs (a high LR wins early
and loses in the schedule's tail); with --sweep-steps equal to --steps every point is a full run and the best one
is the method's result. The JSON records every point, the chosen pair and whether it lies on the grid's edge.
--branch-lr-scales (issue 28) adds a third axis for the swept methods with a branch: factors of the preset's
train.lr (not the point's, so the three rates are swept independently) as `method.branch_lr`, the branch's own
DeepSpeed group (`sweep_b<b>_d<d>_r<r>`); other runs keep the preset's (null: the branch on train.lr).

A whole protocol in stages, on a SLURM cluster or here (`--plan`, its own options: bench/quality_plan.py):

    python -m bench.bench_quality --plan paper_60m --data data/c4_60m --root runs/paper_60m --executor slurm \\
        --partition gpu --account proj --time 180
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from bench import quality_plan
from bench.quality_runs import (RunInTheWay, RunOutcome, RunSpec, base_overrides, data_dir, full_spec, parse_args,
                                point_key, preset_lrs, refuse_to_replace, sweep_specs, train)
from distsparse.report import machine_info, print_table, write_json

REFERENCE_DENSE = "dense_adamw"
_SPARSITY_SUFFIX = re.compile(r"_(\d+)of(\d+)_(row|block)$")
# Settings that make two results comparable; a JSON written under other values is refused, not extended.
COMPARED_KEYS = ("data", "model", "steps", "micro_batch", "seq_len", "eval_interval", "eval_samples", "seed",
                 "warmup_steps", "ds_config", "overrides")


def run_method(args: argparse.Namespace, method: str, label: str) -> dict[str, Any]:
    """Train `method` (after its LR sweep, if asked) and return its JSON entry."""
    entry: dict[str, Any] = {}
    scale, dense_scale, branch_scale, chosen = 1.0, 1.0, None, None
    if method in args.lr_sweep:
        full_length = args.sweep_steps == args.steps
        outcomes = {}   # (backbone scale, dense-side scale[, branch scale]) -> (spec, outcome)
        specs = sweep_specs(args, method)
        for i, (key, spec) in enumerate(specs.items(), start=1):
            b, d, r = (*key, None)[:3]
            branch = "" if r is None else f", branch x{r:g} (method.branch_lr {spec.branch_lr:.3g})"
            print(f"{label}: LR sweep {i}/{len(specs)}: backbone x{b:g} (method.lr {spec.lr:.3g}), dense side "
                  f"x{d:g} (train.lr {spec.dense_lr:.3g}){branch}, {args.sweep_steps} steps", flush=True)
            outcomes[key] = (spec, train(args, spec))
        points = [sweep_point(key, spec, outcome) for key, (spec, outcome) in outcomes.items()]
        # Per method: invocations that extend one JSON may sweep different methods differently.
        entry["lr_sweep"] = {"steps": args.sweep_steps, "points": points}
        finished = [p for p in points if p["final_ppl"] is not None]
        if not finished:
            lr, dense_lr = preset_lrs(method, base_overrides(args))
            return {"final_ppl": None, "curve": [], "lr": lr, "dense_lr": dense_lr,
                    "skipped": "LR sweep: no sweep run finished", **entry}
        best = min(finished, key=lambda p: p["final_ppl"])
        scale, dense_scale, branch_scale = best["lr_scale"], best["dense_lr_scale"], best.get("branch_lr_scale")
        # [backbone, dense side(, branch)]; on the edge of the grid the optimum may lie outside it.
        entry["lr_sweep"].update(chosen_scales=[scale, dense_scale, *([] if branch_scale is None else [branch_scale])],
                                 chosen_on_edge=on_grid_edge(scale, args.lr_scales) or
                                 on_grid_edge(dense_scale, args.dense_lr_scales) or
                                 (branch_scale is not None and on_grid_edge(branch_scale, args.branch_lr_scales)))
        branch = "" if branch_scale is None else f", branch x{branch_scale:g}"
        print(f"{label}: LR sweep chose backbone x{scale:g}, dense side x{dense_scale:g}{branch}", flush=True)
        if full_length:
            chosen = outcomes[point_key(scale, dense_scale, branch_scale)]
    if chosen is not None:
        spec, outcome = chosen
    else:
        spec = full_spec(args, method, scale, dense_scale, branch_scale)
        outcome = train(args, spec)
    wall_s = round(outcome.wall_s, 1) if outcome.wall_s is not None else None
    branch = {} if spec.branch_lr is None else {"branch_lr": spec.branch_lr}
    return {"final_ppl": outcome.final_ppl, "curve": outcome.curve, "lr": spec.lr, "dense_lr": spec.dense_lr,
            **branch, "skipped": outcome.skipped, "final_val_loss": outcome.final_val_loss,
            "final_train_loss": outcome.final_train_loss, "wall_s": wall_s, "nproc": args.nproc,
            "run_dir": str(spec.out_dir), **entry}


def sweep_point(key: tuple[float, ...], spec: RunSpec, outcome: RunOutcome) -> dict[str, Any]:
    """One sweep point of the JSON: its scales, rates and final PPL (the branch's only on that axis)."""
    point = {"lr_scale": key[0], "dense_lr_scale": key[1], "lr": spec.lr, "dense_lr": spec.dense_lr}
    if len(key) > 2:
        point.update(branch_lr_scale=key[2], branch_lr=spec.branch_lr)
    return {**point, "final_ppl": outcome.final_ppl, "skipped": outcome.skipped}


def on_grid_edge(scale: float, scales: list[float]) -> bool:
    """True when `scale` is the smallest or the largest of a sweep axis with more than one value."""
    return len(scales) > 1 and scale in (min(scales), max(scales))


# ---- comparison ------------------------------------------------------------------------------------------

def comparison_config(args: argparse.Namespace, meta: dict) -> dict[str, Any]:
    eval_interval = args.steps // args.eval_points
    return {
        "data": data_dir(args), "data_source": meta.get("source"), "vocab_size": meta["vocab_size"],
        "model": args.model, "steps": args.steps, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "tokens_per_step": args.micro_batch * args.seq_len,
        "total_tokens": args.steps * args.micro_batch * args.seq_len,
        "eval_interval": eval_interval, "eval_samples": args.eval_samples, "seed": args.seed,
        "warmup_steps": args.warmup_steps, "ds_config": args.ds_config, "overrides": list(args.overrides),
        "nproc": args.nproc,
    }


def load_previous(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Methods of an earlier invocation with the same comparison config; refuse a JSON of another one."""
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    differ = [f"{k} ({previous['config'].get(k)!r} there, {config[k]!r} now)" for k in COMPARED_KEYS
              if previous["config"].get(k) != config[k]]
    if differ:
        raise ValueError(f"--json: {path} holds a comparison with other settings: {'; '.join(differ)}; "
                         "allowed: the same settings, or another --json path")
    return previous["methods"]


def reference_ratios(methods: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Per method: final PPL over dense_adamw's and over chts24 of the same sparsity and layout (None if absent)."""
    def ratio(own: float | None, name: str | None) -> float | None:
        other = methods[name]["final_ppl"] if name in methods else None
        return own / other if own and other else None

    out = {}
    for name, entry in methods.items():
        suffix = _SPARSITY_SUFFIX.search(name)   # `_1of4_row` of `chtsnm_1of4_row`; none for a dense preset
        out[name] = {"vs_dense": ratio(entry["final_ppl"], REFERENCE_DENSE),
                     "vs_chts24": ratio(entry["final_ppl"], suffix and f"chts24{suffix.group(0)}")}
    return out


def print_results(methods: dict[str, dict]) -> None:
    ratios = reference_ratios(methods)
    rows = []
    ranked = sorted(methods, key=lambda m: (methods[m]["final_ppl"] is None, methods[m]["final_ppl"] or 0.0))
    for name in ranked:
        entry = methods[name]
        if entry["final_ppl"] is None:
            rows.append([name, "-", "-", "-", f"{entry['lr']:.3g}", f"{entry['dense_lr']:.3g}",
                         f"skipped: {entry['skipped']}"[:100]])
            continue
        rows.append([name, f"{entry['final_ppl']:.2f}",
                     *(f"{ratios[name][k]:.3f}" if ratios[name][k] is not None else "-"
                       for k in ("vs_dense", "vs_chts24")), f"{entry['lr']:.3g}", f"{entry['dense_lr']:.3g}",
                     sweep_note(entry)])
    print_table(["method", "final PPL", f"/ {REFERENCE_DENSE}", "/ chts24 same N:M", "lr", "dense lr", "note"], rows)


def sweep_note(entry: dict) -> str:
    """`sweep (1500 steps) b0.5: d1 63.67 d2 60.12; b1: d1 58.40 d2 57.93 | best b1 d2 (edge)`: every point's
    final PPL by backbone scale b and dense-side scale d (and branch scale r: `d1r0.5`), and the chosen pair;
    "" for an unswept method."""
    if "lr_sweep" not in entry:
        return ""
    sweep = entry["lr_sweep"]
    rows: dict[float, list[str]] = {}
    for p in sweep["points"]:
        ppl = f"{p['final_ppl']:.2f}" if p["final_ppl"] is not None else "failed"
        branch = f"r{p['branch_lr_scale']:g}" if "branch_lr_scale" in p else ""
        rows.setdefault(p["lr_scale"], []).append(f"d{p['dense_lr_scale']:g}{branch} {ppl}")
    grid = "; ".join(f"b{b:g}: {' '.join(cells)}" for b, cells in rows.items())
    note = f"sweep ({sweep['steps']} steps) {grid}"
    if "chosen_scales" in sweep:
        edge = " (edge)" if sweep["chosen_on_edge"] else ""
        chosen = sweep["chosen_scales"]
        branch = f" r{chosen[2]:g}" if len(chosen) > 2 else ""
        note += f" | best b{chosen[0]:g} d{chosen[1]:g}{branch}{edge}"
    return note


def plot(path: Path, methods: dict[str, dict], config: dict[str, Any]) -> None:
    """Validation PPL against training tokens, one line per method with a curve; written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, entry in methods.items():
        points = [(t, p) for t, p in entry["curve"] if p is not None]
        if points:
            final = f"{entry['final_ppl']:.2f}" if entry["final_ppl"] is not None else "failed"
            ax.plot(*zip(*points), marker="o", markersize=3, label=f"{name} ({final})")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation PPL (token-weighted)")
    ax.set_yscale("log")
    ax.set_title(f"model {config['model']}, {config['steps']} steps x {config['tokens_per_step']} tokens, "
                 f"data {Path(config['data']).name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def done_in_json(args: argparse.Namespace, previous: dict | None) -> bool:
    """True when a method's entry from an earlier invocation is a result this invocation keeps."""
    return previous is not None and previous["skipped"] is None and not args.force


def planned_runs(args: argparse.Namespace, method: str) -> list[RunSpec]:
    """The runs of `method` known before any training: its sweep points, or its full run at the preset's rates.
    (The full run after a short sweep depends on the sweep's outcome.)"""
    if method in args.lr_sweep:
        return list(sweep_specs(args, method).values())
    return [full_spec(args, method, 1.0, 1.0)]


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # Unwinds through train()'s finally, which stops the running subprocess.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--plan" or a.startswith("--plan=") for a in argv):
        return quality_plan.main(argv)   # a protocol in stages (configs/plans/): its own options
    try:
        args = parse_args(argv, __doc__.split("\n\n")[0])
        meta = json.loads((Path(args.data) / "meta.json").read_text())
        config = comparison_config(args, meta)
        json_path = Path(args.json)
        methods = load_previous(json_path, config)
        for method in args.methods:   # unknown presets fail before any training
            preset_lrs(method, base_overrides(args))
        for method in args.methods:   # so does a finished run that training would replace
            if not done_in_json(args, methods.get(method)):
                for spec in planned_runs(args, method):
                    refuse_to_replace(args, spec)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    previous_handler = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        for i, method in enumerate(args.methods, start=1):
            label = f"[{i}/{len(args.methods)}] {method}"
            previous = methods.get(method)
            if done_in_json(args, previous):
                print(f"{label}: in {json_path} already (final PPL {previous['final_ppl']:.2f}); skipped "
                      "(--force reruns it)", flush=True)
                continue
            print(f"{label}: training", flush=True)
            try:
                entry = methods[method] = run_method(args, method, label)
            except RunInTheWay as err:   # the full run after a short sweep, known only now; JSON holds the rest
                print(f"error: {err}", file=sys.stderr)
                return 2
            status = f"final PPL {entry['final_ppl']:.2f}" if entry["skipped"] is None else \
                f"skipped: {entry['skipped']}"
            print(f"{label}: {status}", flush=True)
            write_json(json_path, {"machine": machine_info(), "config": config, "methods": methods})
            if args.plot:
                plot(Path(args.plot), methods, config)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    if args.plot:   # also after an invocation that skipped every method
        plot(Path(args.plot), methods, config)
    print_results(methods)
    return 0


if __name__ == "__main__":
    sys.exit(main())
