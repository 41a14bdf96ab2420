"""Summary of a full-length bench_quality comparison run over seeds (issue 17 item 7): per method, the grid of
final validation PPL over (backbone scale b, dense-side scale d) at seed 0, its best pair and whether that pair is
interior; the seeds run at the best pair (mean, min, max); and every pairwise ordering of the seed means, with
whether it holds on every seed (the same seeds, each one ordered the same way).

    python tools/quality_summary.py --root docs/results/quality_small_tied --json docs/results/quality_small_tied.json

Reads `<root>/seed<S>/<method>/sweep_b<b>_d<d>/{config.json,result.json}`, the directories bench_quality's
full-length sweep leaves (`--out-root <root>/seed<S>`, `--seed S`); the grid can be partial while the comparison is
still running: a directory without a result.json of its config's step count (in flight, or cut short) is listed as
missing, and a finished run whose final PPL is not finite (the trainer writes NaN for a diverged run) as diverged,
neither ranked. Every finished run must share one protocol (its config less the method, the two learning rates, the
seed and the output directory), every finished run of a method its method settings (less the backbone learning
rate), and every finished run at one pair of a method its two learning rates; a run that differs is refused by name,
with the keys that differ, so numbers of different budgets or settings are never ranked or averaged together.

A best pair is interior when finished points at the same d lie on both sides of its b, and at the same b on both
sides of its d; otherwise the optimum may lie outside what was run (widen the grid there). The seed-0 grid chooses
the pair; the other seeds only run it.
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

from benchlib import add_json_arg, machine_info, print_table, write_json
from distsparse.utils import config_differences

SCALE = r"[0-9]+(?:\.[0-9]+)?(?:e[+-][0-9]+)?"   # a positive scale as bench_quality names it: f"{scale:g}"
RUN_DIR = re.compile(f"sweep_b(?P<b>{SCALE})_d(?P<d>{SCALE})")
SEED_DIR = re.compile(r"seed(?P<seed>[0-9]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="folder holding seed<S>/<method>/sweep_b<b>_d<d> run directories")
    add_json_arg(p)
    return p.parse_args(argv)


def protocol(config: dict[str, Any]) -> dict[str, Any]:
    """What every run of one comparison shares: the config less what the comparison varies."""
    shared = {k: v for k, v in config.items() if k != "method"}
    shared["train"] = {k: v for k, v in config["train"].items() if k not in ("lr", "seed", "out_dir")}
    return shared


def read_runs(root: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every run directory under `root` as {seed, method, b, d, lr, dense_lr, finished, ppl (None: unfinished or
    diverged), path}, and the protocol they share; raises ValueError naming a run whose protocol, method settings,
    learning rates at its pair or seed differ."""
    runs: list[dict[str, Any]] = []
    seen: dict[tuple, tuple[Path, dict[str, Any]]] = {}   # what was checked -> (first finished run, its value)
    for run_dir in sorted(root.glob("seed*/*/sweep_*")):
        seed_match, name_match = SEED_DIR.fullmatch(run_dir.parent.parent.name), RUN_DIR.fullmatch(run_dir.name)
        if seed_match is None or name_match is None or not (run_dir / "config.json").is_file():
            continue
        config = json.loads((run_dir / "config.json").read_text())
        seed, method = int(seed_match["seed"]), run_dir.parent.name
        b, d = float(name_match["b"]), float(name_match["d"])
        lr, dense_lr = config["method"]["lr"], config["train"]["lr"]
        if config["train"]["seed"] != seed or config["method"]["preset"] != method:
            raise ValueError(f"{run_dir}: config.json holds train.seed {config['train']['seed']} and method.preset "
                             f"{config['method']['preset']!r}; allowed: the seed and method its path names")
        result_path = run_dir / "result.json"
        result = json.loads(result_path.read_text()) if result_path.is_file() else None
        finished = result is not None and result["step"] == config["train"]["steps"]
        if finished:   # an unfinished run's config may be of an earlier protocol that a rerun will replace
            _check_same(seen, ("protocol",), protocol(config), run_dir, "another protocol")
            _check_same(seen, ("method", method), {"method": {k: v for k, v in config["method"].items() if k != "lr"}},
                        run_dir, "other method settings")
            _check_same(seen, ("rates", method, b, d), {"method.lr": lr, "train.lr": dense_lr}, run_dir,
                        f"other learning rates at b{b:g} d{d:g}")
        ppl = result["final/val_ppl"] if finished else None
        runs.append({"seed": seed, "method": method, "b": b, "d": d, "lr": lr, "dense_lr": dense_lr,
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
    """True when finished points surround `best` on both axes (same d on both sides of its b, and vice versa)."""
    same_d = [p["b"] for p in grid if p["d"] == best["d"]]
    same_b = [p["d"] for p in grid if p["b"] == best["b"]]
    return (min(same_d) < best["b"] < max(same_d)) and (min(same_b) < best["d"] < max(same_b))


def summarize_method(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's seed-0 grid, best pair and the seeds at that pair; `off_pair` lists the other seeds' finished
    runs at another pair (run at an earlier best pair, before the grid was widened), which are not used."""
    grid = [r for r in runs if r["seed"] == 0 and r["ppl"] is not None]
    best = min(grid, key=lambda r: r["ppl"]) if grid else None
    entry: dict[str, Any] = {
        "grid": [{k: r[k] for k in ("b", "d", "lr", "dense_lr", "ppl")} for r in sorted(grid, key=_pair)],
        "missing": sorted(_label(r) for r in runs if not r["finished"]),
        "diverged": sorted(_label(r) for r in runs if r["finished"] and r["ppl"] is None),
        "off_pair": sorted(_label(r) for r in runs if r["seed"] != 0 and r["ppl"] is not None
                           and (best is None or _pair(r) != _pair(best)))}
    if best is None:
        return entry
    seeds = {r["seed"]: r["ppl"] for r in runs if _pair(r) == _pair(best) and r["ppl"] is not None}
    values = list(seeds.values())
    entry.update(best={"b": best["b"], "d": best["d"], "lr": best["lr"], "dense_lr": best["dense_lr"]},
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


def _pair(run: dict[str, Any]) -> tuple[float, float]:
    return run["b"], run["d"]


def _label(run: dict[str, Any]) -> str:
    return f"seed{run['seed']} b{run['b']:g} d{run['d']:g}"


def print_summary(summary: dict[str, Any]) -> None:
    for method, entry in summary["methods"].items():
        ds = sorted({p["d"] for p in entry["grid"]})
        bs = sorted({p["b"] for p in entry["grid"]})
        cell = {_pair(p): p["ppl"] for p in entry["grid"]}
        print(f"\n{method}: seed-0 final val PPL, rows backbone scale b, columns dense-side scale d")
        if not entry["grid"]:
            print("no finished run")
        else:
            print_table(["b", *(f"d{d:g}" for d in ds)],
                        [[f"b{b:g}", *(cell.get((b, d), "-") for d in ds)] for b in bs])
        if entry["missing"]:
            print(f"unfinished: {', '.join(entry['missing'])}")
        if entry["diverged"]:
            print(f"diverged (non-finite PPL, not ranked): {', '.join(entry['diverged'])}")
        if entry["off_pair"]:
            print(f"not at the best pair (not used): {', '.join(entry['off_pair'])}")
    rows = [[m, f"b{e['best']['b']:g} d{e['best']['d']:g}", "yes" if e["best_interior"] else "no (edge)",
             len(e["seeds"]), e["mean"], e["min"], e["max"]]
            for m, e in sorted(summary["methods"].items(), key=lambda kv: kv[1].get("mean", float("inf")))
            if "mean" in e]
    print()
    print_table(["method", "best pair", "interior", "seeds", "mean PPL", "min", "max"], rows)
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
