"""Summary of a full-length bench_quality comparison over seeds (issue 17 item 7): per method, the seed-0 grid of
final validation PPL over (backbone scale b, dense-side scale d[, branch scale r]), its best point and whether
that point is interior (finished points on both sides of it on each swept axis; otherwise the optimum may lie
outside what was run); its seed-0 PPL at b1 d1 (`fixed_rate_ppl`: the presets' own rates, the paper's fixed-rate
protocol); the seeds run at the best point (mean, min, max); and every pairwise ordering of the seed means, with
whether it holds on every seed. The seed-0 grid chooses the point; the other seeds only run it.

    python -m bench.quality_summary --root docs/results/quality_small_tied --json docs/results/quality_small_tied.json

Reads `<root>/seed<S>/<method>/sweep_b<b>_d<d>[_r<r>]/{config.json,result.json}` (bench_quality's full-length
sweep with `--out-root <root>/seed<S> --seed S`, or its --plan). The grid can be partial: a directory without a
result.json of its config's step count is missing, a finished run with a non-finite PPL diverged; neither is
ranked. A run without r (the branch on train.lr, or no branch; one recorded before method.branch_lr existed reads
as it null) is a point of the b x d grid. Every finished run must share one protocol (its config less the method,
the two learning rates, the seed and the output directory), every finished run of a method its method settings
(less its rates), and every finished run at one point its rates: a run that differs is refused by name, with the
keys that differ, so numbers of different budgets or settings are never ranked or averaged together.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.quality_runs import POINT_DIR, comparable, point_name
from distsparse.config import with_added_keys
from distsparse.report import add_json_arg, machine_info, print_table, write_json
from distsparse.utils import config_differences

SEED_DIR = re.compile(r"seed(?P<seed>[0-9]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.quality_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="folder holding seed<S>/<method>/sweep_b<b>_d<d> run directories")
    add_json_arg(p)
    return p.parse_args(argv)


def protocol(config: dict[str, Any]) -> dict[str, Any]:
    """What every run of one comparison shares: the config less what the comparison varies."""
    shared = {k: v for k, v in comparable(config).items() if k != "method"}
    shared["train"] = {k: v for k, v in shared["train"].items() if k not in ("lr", "seed")}
    return shared


def read_runs(root: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every run directory under `root` as {seed, method, b, d, r (None: no branch axis), lr, dense_lr, branch_lr,
    finished, ppl (None: unfinished or diverged), path}, and the protocol they share; raises ValueError naming a run
    whose protocol, method settings, learning rates at its point or seed differ."""
    runs: list[dict[str, Any]] = []
    seen: dict[tuple, tuple[Path, dict[str, Any]]] = {}   # what was checked -> (first finished run, its value)
    for run_dir in sorted(root.glob("seed*/*/sweep_*")):
        seed_match, name_match = SEED_DIR.fullmatch(run_dir.parent.parent.name), POINT_DIR.fullmatch(run_dir.name)
        if seed_match is None or name_match is None or not (run_dir / "config.json").is_file():
            continue
        config = with_added_keys(json.loads((run_dir / "config.json").read_text()))
        seed, method = int(seed_match["seed"]), run_dir.parent.name
        b, d = float(name_match["b"]), float(name_match["d"])
        r = float(name_match["r"]) if name_match["r"] is not None else None
        lr, dense_lr, branch_lr = config["method"]["lr"], config["train"]["lr"], config["method"]["branch_lr"]
        if config["train"]["seed"] != seed or config["method"]["preset"] != method:
            raise ValueError(f"{run_dir}: config.json holds train.seed {config['train']['seed']} and method.preset "
                             f"{config['method']['preset']!r}; allowed: the seed and method its path names")
        result_path = run_dir / "result.json"
        result = json.loads(result_path.read_text()) if result_path.is_file() else None
        finished = result is not None and result["step"] == config["train"]["steps"]
        if finished:   # an unfinished run's config may be of an earlier protocol that a rerun will replace
            _check_same(seen, ("protocol",), protocol(config), run_dir, "another protocol")
            settings = {k: v for k, v in config["method"].items() if k not in ("lr", "branch_lr")}
            _check_same(seen, ("method", method), {"method": settings}, run_dir, "other method settings")
            _check_same(seen, ("rates", method, b, d, r),
                        {"method.lr": lr, "train.lr": dense_lr, "method.branch_lr": branch_lr}, run_dir,
                        f"other learning rates at {_point_label(b, d, r)}")
        ppl = result["final/val_ppl"] if finished else None
        runs.append({"seed": seed, "method": method, "b": b, "d": d, "r": r, "lr": lr, "dense_lr": dense_lr,
                     "branch_lr": branch_lr,
                     "finished": finished, "ppl": ppl if ppl is not None and math.isfinite(ppl) else None,
                     "path": str(run_dir)})
    return runs, seen[("protocol",)][1] if ("protocol",) in seen else None


def _check_same(seen: dict[tuple, tuple[Path, dict[str, Any]]], key: tuple, value: dict[str, Any], run_dir: Path,
                what: str) -> None:
    """Record `value` under `key`, or raise naming `run_dir` and the keys that differ from the first run's."""
    first, expected = seen.setdefault(key, (run_dir, value))
    if value != expected:
        differ = list(config_differences(expected, value))
        raise ValueError(f"{run_dir}: {what} than {first} (differ: {', '.join(differ)}); allowed: runs of one "
                         "comparison under one --root")


def interior(best: dict[str, Any], grid: list[dict[str, Any]]) -> bool:
    """True when finished points surround `best` on each of its axes (the same d and r on both sides of its b, the
    same b and r on both sides of its d, and, with a branch axis, the same b and d on both sides of its r). An axis
    the grid holds one value of was not swept (a plan's one dense-side rate: bench_quality --plan) and is not checked."""
    axes = ("b", "d") if best.get("r") is None else ("b", "d", "r")
    for axis in axes:
        if len({p.get(axis) for p in grid}) == 1:
            continue
        # a point without r (the branch on train.lr) is no value of the r axis
        line = [p[axis] for p in grid if p.get(axis) is not None
                and all(p.get(a) == best.get(a) for a in ("b", "d", "r") if a != axis)]
        if not min(line) < best[axis] < max(line):
            return False
    return True


def summarize_method(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's seed-0 grid, best pair and the seeds at that pair; `off_pair` lists the other seeds' finished
    runs at another pair (run at an earlier best pair, before the grid was widened), which are not used."""
    grid = [r for r in runs if r["seed"] == 0 and r["ppl"] is not None]
    best = min(grid, key=lambda r: r["ppl"]) if grid else None
    # b1 d1: the presets' own rates, the paper's fixed-rate protocol (TANS 1e-3, the Adam family 3e-3, the rest 3e-3)
    fixed = next((r["ppl"] for r in grid if _pair(r) == (1.0, 1.0, None)), None)
    entry: dict[str, Any] = {
        "fixed_rate_ppl": fixed,
        "grid": [_grid_point(r) for r in sorted(grid, key=_sort_key)],
        "missing": sorted(_label(r) for r in runs if not r["finished"]),
        "diverged": sorted(_label(r) for r in runs if r["finished"] and r["ppl"] is None),
        "off_pair": sorted(_label(r) for r in runs if r["seed"] != 0 and r["ppl"] is not None
                           and (best is None or _pair(r) != _pair(best)))}
    if best is None:
        return entry
    seeds = {r["seed"]: r["ppl"] for r in runs if _pair(r) == _pair(best) and r["ppl"] is not None}
    values = list(seeds.values())
    entry.update(best={k: v for k, v in _grid_point(best).items() if k != "ppl"},
                 best_interior=interior(best, grid), seeds={str(s): seeds[s] for s in sorted(seeds)},
                 mean=statistics.fmean(values), min=min(values), max=max(values))
    return entry


def orderings(methods: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pair of summarized methods, lower seed mean first: the ratio of the means; `every_seed`, whether the
    lower one is lower on each seed (paired: a seed gives every method the same data order), None when the two did
    not run the same seeds (a one-seed baseline against a three-seed method); and `ranges_apart`, whether the lower
    one's worst seed is below the other's best, the unpaired and stronger statement."""
    ranked = sorted((m for m in methods if "mean" in methods[m]), key=lambda m: methods[m]["mean"])
    return [{"lower": a, "higher": b, "ratio": methods[a]["mean"] / methods[b]["mean"],
             "every_seed": _lower_on_every_seed(methods[a]["seeds"], methods[b]["seeds"]),
             "ranges_apart": methods[a]["max"] < methods[b]["min"],
             "seeds": [len(methods[a]["seeds"]), len(methods[b]["seeds"])]}
            for a, b in itertools.combinations(ranked, 2)]


def _lower_on_every_seed(lower: dict[str, float], higher: dict[str, float]) -> bool | None:
    if lower.keys() != higher.keys():
        return None
    return all(lower[s] < higher[s] for s in lower)


def summarize(root: Path) -> dict[str, Any]:
    runs, shared = read_runs(root)
    if not runs:
        raise ValueError(f"--root: no seed<S>/<method>/sweep_b<b>_d<d> run directory under {root}")
    by_method = {m: [r for r in runs if r["method"] == m] for m in sorted({r["method"] for r in runs})}
    methods = {m: summarize_method(rs) for m, rs in by_method.items()}
    return {"config": {"root": str(root), "protocol": shared}, "methods": methods, "orderings": orderings(methods)}


def _pair(run: dict[str, Any]) -> tuple[float, float, float | None]:
    """The run's point: (b, d, r), r None without a branch axis."""
    return run["b"], run["d"], run.get("r")


def _sort_key(run: dict[str, Any]) -> tuple[float, float, float]:
    r = run.get("r")
    return run["b"], run["d"], -1.0 if r is None else r


def _grid_point(run: dict[str, Any]) -> dict[str, Any]:
    """A point of the JSON grid; r and branch_lr only on a branch axis, so a b x d grid keeps its layout."""
    point = {k: run[k] for k in ("b", "d", "lr", "dense_lr")}
    if run.get("r") is not None:
        point.update(r=run["r"], branch_lr=run["branch_lr"])
    return {**point, "ppl": run["ppl"]}


def _point_label(b: float, d: float, r: float | None) -> str:
    return point_name(b, d, r).replace("_", " ")


def _label(run: dict[str, Any]) -> str:
    return f"seed{run['seed']} {_point_label(*_pair(run))}"


def print_summary(summary: dict[str, Any]) -> None:
    for method, entry in summary["methods"].items():
        ds = sorted({p["d"] for p in entry["grid"]})
        bs = sorted({p["b"] for p in entry["grid"]})
        rs = sorted({p.get("r") for p in entry["grid"]}, key=lambda r: -1.0 if r is None else r)
        cell = {_pair(p): p["ppl"] for p in entry["grid"]}
        if not entry["grid"]:
            print(f"\n{method}: no finished run")
        for r in rs:   # one b x d table per branch scale (None: no branch axis)
            at = "" if r is None else f", branch scale r{r:g}"
            print(f"\n{method}: seed-0 final val PPL, rows backbone scale b, columns dense-side scale d{at}")
            print_table(["b", *(f"d{d:g}" for d in ds)],
                        [[f"b{b:g}", *(cell.get((b, d, r), "-") for d in ds)] for b in bs])
        if entry["missing"]:
            print(f"unfinished: {', '.join(entry['missing'])}")
        if entry["diverged"]:
            print(f"diverged (non-finite PPL, not ranked): {', '.join(entry['diverged'])}")
        if entry["off_pair"]:
            print(f"not at the best pair (not used): {', '.join(entry['off_pair'])}")
    rows = [[m, _point_label(*_pair(e["best"])), "yes" if e["best_interior"] else "no (edge)",
             len(e["seeds"]), e["mean"], e["min"], e["max"]]
            for m, e in sorted(summary["methods"].items(), key=lambda kv: kv[1].get("mean", float("inf")))
            if "mean" in e]
    print()
    print_table(["method", "best pair", "interior", "seeds", "mean PPL", "min", "max"], rows)
    fixed = sorted((e["fixed_rate_ppl"], m) for m, e in summary["methods"].items() if e["fixed_rate_ppl"] is not None)
    if fixed:
        print("\nthe paper's fixed rates (b1 d1: the presets' own rates), seed 0")
        print_table(["method", "final PPL", "/ best"], [[m, ppl, ppl / fixed[0][0]] for ppl, m in fixed])
    print()
    paired = {True: "yes", False: "no", None: "-"}   # "-": the two ran different seeds
    print_table(["lower", "higher", "ratio of means", "on every seed", "ranges apart", "seeds"],
                [[o["lower"], o["higher"], o["ratio"], paired[o["every_seed"]], "yes" if o["ranges_apart"] else "no",
                  "/".join(map(str, o["seeds"]))] for o in summary["orderings"]])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = summarize(Path(args.root))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_summary(summary)
    if args.json:
        write_json(args.json, {"machine": machine_info(), **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
