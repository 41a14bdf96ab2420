"""The runs of a quality comparison (bench_quality, quality_plan, quality_summary): the comparison's settings, one
run's overrides and directory name, its training subprocess, and reading a finished run back (result, config,
curves).

A run is launch/pretrain.py in a subprocess (plain `python` for one process, the `deepspeed` launcher for
--nproc N). Its directory is OUT_ROOT/METHOD/{full,sweep_b<b>_d<d>[_r<r>]}, the scales written as f"{scale:g}".
A directory that holds result.json and a config.json equal to the run's resolved config (all but `train.out_dir`
and the sections that change no number: checkpointing, logging) is read back, not retrained; a finished run there
under another config is refused, naming the keys that differ (--force replaces it). A run's curves are kept as
RUN_DIR/curves.csv, written from its TensorBoard events (tb/) whenever the run is read: docs/results keeps
config.json, result.json and curves.csv of a run, not its event files.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distsparse.config import RESULT_NEUTRAL_SECTIONS, config_to_dict, load_config, with_added_keys
from distsparse.cli.launch_env import free_port
from distsparse.utils import config_differences

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LR_SCALES = "0.5,1,2"
SWEEP_STEP_FRACTION = 4          # default sweep runs train steps // 4 steps
LOG_TAIL_LINES = 30              # lines of a failed run's output kept for its "skipped" reason
SCALE = r"[0-9]+(?:\.[0-9]+)?(?:e[+-][0-9]+)?"   # a positive scale as f"{scale:g}" writes it
POINT_DIR = re.compile(f"sweep_b(?P<b>{SCALE})_d(?P<d>{SCALE})(?:_r(?P<r>{SCALE}))?")
CURVES_FILE = "curves.csv"
CURVE_TAGS = ("loss/train", "loss/val", "loss/val_ppl", "optim/grad_norm")   # what the README's figures redraw


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """bench_quality's settings (a comparison); ValueError names a bad one."""
    p = argparse.ArgumentParser(prog="python -m bench.bench_quality", description=description,
                                epilog="a protocol in stages (configs/plans/) instead: --plan NAME, whose options "
                                       "`python -m bench.bench_quality --plan NAME --help` lists")
    add = p.add_argument
    add("--data", required=True, help="prepared data directory (data_prep; its vocab sizes the model)")
    add("--methods", required=True, help="comma-separated method presets (configs/method/*.yaml)")
    add("--model", default="small", help="model preset (configs/model/*.yaml; default small)")
    add("--steps", type=int, required=True, help="optimizer steps per method")
    add("--micro-batch", type=int, default=8,
        help="sequences per optimizer step over all ranks (default 8; each rank takes 1/nproc)")
    add("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    add("--eval-points", type=int, default=10, help="K: evaluate every steps // K steps and at the last (default 10)")
    add("--eval-samples", type=int, default=256, help="validation sequences per evaluation, 0 for all (default 256)")
    add("--seed", type=int, default=0, help="model init and data order seed (default 0)")
    add("--warmup-steps", type=int, default=None, help="LR warmup steps (default: the trainer's train.warmup_steps)")
    add("--lr-sweep", default="", metavar="METHOD,...",
        help="methods to tune first: one run per pair of a --lr-scales factor of the preset's method.lr (backbone) "
             "and a --dense-lr-scales factor of its train.lr (dense side), each on --sweep-steps steps; the full "
             "run then uses the pair with the lowest final PPL")
    for flag, what in (("--lr-scales", "backbone LR (method.lr)"), ("--dense-lr-scales", "dense-side LR (train.lr)")):
        add(flag, default=DEFAULT_LR_SCALES, metavar="S,...", help=f"{what} factors (default {DEFAULT_LR_SCALES})")
    add("--branch-lr-scales", default="", metavar="S,...",
        help="method.branch_lr factors of the preset's train.lr: a third sweep axis for the swept methods with a "
             "branch (default: none, the preset's method.branch_lr)")
    add("--sweep-steps", type=int, default=None, help=f"steps per sweep run (default steps // "
        f"{SWEEP_STEP_FRACTION}); equal to --steps, the best sweep run is the method's result")
    add("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="extra config override for every run (repeatable), e.g. --set train.grad_clip=0.5")
    add("--nproc", type=int, default=1, help="ranks per run (default 1: plain python; N > 1: the deepspeed launcher)")
    add("--ds-config", default="configs/ds/zero2.json", help="DeepSpeed JSON, relative to the repository root")
    add("--out-root", default="runs/quality", help="run directories: OUT_ROOT/METHOD/{full,sweep_b1_d1,...}")
    add("--json", required=True, metavar="PATH", help="results JSON (read first: finished methods skip)")
    add("--plot", default=None, metavar="PATH", help="PNG of validation PPL against training tokens")
    add("--keep-checkpoint", action="store_true", help="keep each run's final checkpoint in RUN_DIR/checkpoints "
        "(the checkpoint settings are not part of the config a finished run is read back by)")
    add("--force", action="store_true",
        help="rerun methods that already have a result in the JSON, and runs finished in --out-root")
    args = p.parse_args(argv)
    args.methods, args.lr_sweep = split_names(args.methods), split_names(args.lr_sweep)
    args.lr_scales = _parse_scales(args.lr_scales, "--lr-scales")
    args.dense_lr_scales = _parse_scales(args.dense_lr_scales, "--dense-lr-scales")
    args.branch_lr_scales = _parse_scales(args.branch_lr_scales, "--branch-lr-scales") \
        if args.branch_lr_scales.strip() else []
    if args.sweep_steps is None:
        args.sweep_steps = args.steps // SWEEP_STEP_FRACTION
    args.out_root = str(Path(args.out_root).resolve())   # the subprocess runs in the repository root
    _check_args(args)
    return args


def split_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def valid_scales(scales: list) -> bool:
    """True for a non-empty list of distinct positive finite numbers (a sweep axis)."""
    return bool(scales) and len(set(scales)) == len(scales) and all(
        not isinstance(s, bool) and isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in scales)


def _parse_scales(text: str, flag: str) -> list[float]:
    try:
        scales = [float(s) for s in split_names(text)]
    except ValueError:
        scales = []
    if not valid_scales(scales):
        raise ValueError(f"{flag}: got {text!r}; allowed: distinct positive numbers, comma-separated")
    return scales


def _check_args(args: argparse.Namespace) -> None:
    if not args.methods:
        raise ValueError("--methods: got no method; allowed: comma-separated presets of configs/method/")
    if len(set(args.methods)) != len(args.methods):
        raise ValueError(f"--methods: got {','.join(args.methods)}; allowed: each method once")
    unknown = [m for m in args.lr_sweep if m not in args.methods]
    if unknown:
        raise ValueError(f"--lr-sweep: got {','.join(unknown)}; allowed: methods of --methods "
                         f"({','.join(args.methods)})")
    for key in ("steps", "micro_batch", "seq_len", "eval_points", "nproc"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}: got {getattr(args, key)}; allowed: >= 1")
    if args.eval_samples < 0:
        raise ValueError(f"--eval-samples: got {args.eval_samples}; allowed: >= 0 (0: every validation sequence)")
    if args.eval_points > args.steps:
        raise ValueError(f"--eval-points: got {args.eval_points}; allowed: <= --steps ({args.steps})")
    if args.micro_batch % args.nproc:
        raise ValueError(f"--micro-batch: got {args.micro_batch} with --nproc {args.nproc}; allowed: a multiple "
                         f"of --nproc (each rank takes micro_batch / nproc sequences)")
    if args.branch_lr_scales and not args.lr_sweep:
        raise ValueError(f"--branch-lr-scales: got {','.join(f'{r:g}' for r in args.branch_lr_scales)} without "
                         "--lr-sweep; allowed: with --lr-sweep (a sweep axis of the swept methods with a branch)")
    if args.lr_sweep and not 1 <= args.sweep_steps <= args.steps:
        raise ValueError(f"--sweep-steps: got {args.sweep_steps} with --steps {args.steps}; allowed: 1 to --steps "
                         f"(default steps // {SWEEP_STEP_FRACTION})")
    if not (Path(args.data) / "meta.json").exists():
        raise ValueError(f"--data: got {args.data!r}; no meta.json there (prepare it with python -m "
                         f"data_prep.prepare --out {args.data} ...)")


# ---- what one run is ---------------------------------------------------------------------------------------

@dataclass
class RunSpec:
    """One launch/pretrain.py run: the overrides that differ between runs of a comparison."""

    label: str                  # shown before every log line, e.g. "chts24_1of4_row b0.5 d2"
    method: str
    steps: int
    eval_interval: int
    lr: float                   # method.lr (backbone)
    dense_lr: float             # train.lr (DeepSpeed side)
    out_dir: Path
    branch_lr: float | None = None   # method.branch_lr; None: the preset's


@dataclass
class RunOutcome:
    final_ppl: float | None
    final_val_loss: float | None
    final_train_loss: float | None
    curve: list[list[float]]    # [[tokens, ppl], ...]
    skipped: str | None         # why the run gave no usable result; None when it did
    wall_s: float | None        # None: read back from an earlier invocation's run directory


def point_name(b: float, d: float, r: float | None = None) -> str:
    """`b0.5_d2` (`b0.5_d2_r1` with a branch scale): a sweep point's directory name after `sweep_`."""
    return f"b{b:g}_d{d:g}" + ("" if r is None else f"_r{r:g}")


def point_key(b: float, d: float, r: float | None = None) -> tuple[float, ...]:
    return (b, d) if r is None else (b, d, r)


def base_overrides(args: argparse.Namespace) -> list[str]:
    """Overrides shared by every run of the comparison (the caller's --set last, so they win)."""
    out = [f"model.preset={args.model}", f"data.dir={data_dir(args)}", f"data.seq_len={args.seq_len}",
           f"train.micro_batch={args.micro_batch // args.nproc}", "train.grad_accum=1", f"train.seed={args.seed}",
           f"train.eval_samples={args.eval_samples}"]
    if args.warmup_steps is not None:
        out.append(f"train.warmup_steps={args.warmup_steps}")
    return out + list(args.overrides)


def data_dir(args: argparse.Namespace) -> str:
    """--data as the runs record it: relative to the repository root (the runs' working directory) when inside it,
    so finished runs and results JSON committed from one checkout are read back in another."""
    path = Path(args.data).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def preset_lrs(method: str, overrides: list[str]) -> tuple[float, float]:
    """(method.lr, train.lr) of `method` under the comparison's overrides; raises on an unknown preset."""
    cfg = load_config(None, [*overrides, f"method.preset={method}"])
    return cfg.method.lr, cfg.train.lr


def has_branch(method: str, overrides: list[str]) -> bool:
    return load_config(None, [*overrides, f"method.preset={method}"]).method.branch.kind != "none"


def sweep_specs(args: argparse.Namespace, method: str) -> dict[tuple[float, ...], RunSpec]:
    """The runs of `method`'s LR sweep, by (backbone scale, dense-side scale[, branch scale]); the branch axis
    (--branch-lr-scales x the preset's train.lr) only for a method with a branch."""
    lr, dense_lr = preset_lrs(method, base_overrides(args))
    branch = list(args.branch_lr_scales) if args.branch_lr_scales and has_branch(method, base_overrides(args)) \
        else [None]
    # A full-length point may be the result, so it is evaluated at the comparison's token counts.
    sweep_eval = args.steps // args.eval_points if args.sweep_steps == args.steps else args.sweep_steps
    return {point_key(b, d, r): RunSpec(f"{method} {point_name(b, d, r).replace('_', ' ')}", method,
                                        args.sweep_steps, sweep_eval, lr * b, dense_lr * d,
                                        Path(args.out_root) / method / f"sweep_{point_name(b, d, r)}",
                                        None if r is None else dense_lr * r)
            for b in args.lr_scales for d in args.dense_lr_scales for r in branch}


def full_spec(args: argparse.Namespace, method: str, scale: float, dense_scale: float,
              branch_scale: float | None = None) -> RunSpec:
    """The full-length run of `method` at `scale` x its preset's method.lr and `dense_scale` x train.lr (and
    method.branch_lr = `branch_scale` x train.lr, unless None: the preset's)."""
    lr, dense_lr = preset_lrs(method, base_overrides(args))
    return RunSpec(method, method, args.steps, args.steps // args.eval_points, lr * scale, dense_lr * dense_scale,
                   Path(args.out_root) / method / "full", None if branch_scale is None else dense_lr * branch_scale)


def run_overrides(args: argparse.Namespace, run: RunSpec) -> list[str]:
    branch = [] if run.branch_lr is None else [f"method.branch_lr={run.branch_lr!r}"]
    # Checkpointing on with one interval of the whole run: the trainer saves once, at the end.
    keep = [f"checkpoint.interval={run.steps}"] if args.keep_checkpoint else []
    return [*base_overrides(args), f"method.preset={run.method}", f"method.lr={run.lr!r}",
            f"train.lr={run.dense_lr!r}", *branch, *keep, f"train.steps={run.steps}",
            f"train.eval_interval={run.eval_interval}", f"train.out_dir={run.out_dir}"]


def run_command(args: argparse.Namespace, run: RunSpec) -> list[str]:
    overrides = run_overrides(args, run)
    entry = [str(ROOT / "launch" / "pretrain.py"), "--ds_config", str(ROOT / args.ds_config)]
    if args.nproc == 1:
        return [sys.executable, *entry, *overrides]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
    if launcher is None:
        raise ValueError(f"--nproc: got {args.nproc}; the deepspeed launcher is not installed next to "
                         f"{sys.executable} nor on PATH; allowed: 1 without it")
    # The launcher's default port 29500 collides with any other DeepSpeed job on the machine.
    return [launcher, "--num_gpus", str(args.nproc), "--master_port", str(free_port()), *entry, *overrides]


def run_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment of a run's process: `environ`, unbuffered, on the accelerator this machine has."""
    import torch
    env = {**environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    return env


# ---- finished runs -----------------------------------------------------------------------------------------

def comparable(config: dict) -> dict:
    """A recorded or resolved config less what changes no number: train.out_dir, checkpointing and logging."""
    out = {k: v for k, v in with_added_keys(config).items() if k not in RESULT_NEUTRAL_SECTIONS}
    out["train"] = {k: v for k, v in out.get("train", {}).items() if k != "out_dir"}
    return out


def _resolved_config(args: argparse.Namespace, run: RunSpec) -> dict:
    """The config run.out_dir's config.json will hold after this run, comparable()."""
    return comparable(json.loads(json.dumps(config_to_dict(load_config(None, run_overrides(args, run))))))


def _earlier_config(args: argparse.Namespace, run: RunSpec) -> dict | None:
    """The comparable() config of the run that finished in run.out_dir; None when none did, or with --force."""
    if args.force or not (run.out_dir / "result.json").is_file() or not (run.out_dir / "config.json").is_file():
        return None
    return comparable(json.loads((run.out_dir / "config.json").read_text()))   # runs of older checkouts too


def finished_earlier(args: argparse.Namespace, run: RunSpec) -> bool:
    """True when run.out_dir holds the result of a run with this run's resolved config (all but its out_dir)."""
    found = _earlier_config(args, run)
    return found is not None and found == _resolved_config(args, run)


class RunInTheWay(ValueError):
    """A run directory holds a finished run of another config."""


def refuse_to_replace(args: argparse.Namespace, run: RunSpec) -> None:
    """Raise RunInTheWay, naming the keys that differ, when run.out_dir holds a finished run of another config:
    retraining would delete a result that may be the only copy (an hour of CPU). --force replaces it."""
    found = _earlier_config(args, run)
    if found is None or found == (expected := _resolved_config(args, run)):
        return
    differences = list(config_differences(found, expected).items())
    shown = "; ".join(f"{k}: {there!r} there, {here!r} here" for k, (there, here) in differences[:6])
    more = f" and {len(differences) - 6} more" if len(differences) > 6 else ""
    raise RunInTheWay(f"{run.out_dir} holds a finished run of another config ({shown}{more}); give this "
                      "comparison its own --out-root, move that run away, or pass --force to replace it "
                      "(--force also reruns every method of --methods already in the JSON)")


def train(args: argparse.Namespace, run: RunSpec) -> RunOutcome:
    """Run one training subprocess, echoing its output, and read its curve and result back; or read back the
    result an earlier invocation left in run.out_dir under the same config."""
    if finished_earlier(args, run):
        print(f"  [{run.label}] finished earlier in {run.out_dir} with the same config; read back", flush=True)
        return read_outcome(args, run, returncode=0, tail=[], wall_s=None)
    refuse_to_replace(args, run)
    if run.out_dir.exists():
        shutil.rmtree(run.out_dir)   # an interrupted attempt's event files would mix into the curve
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    start = time.perf_counter()
    proc = subprocess.Popen(run_command(args, run), cwd=ROOT, env=run_env(dict(os.environ)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            print(f"  [{run.label}] {line}", flush=True)
        returncode = proc.wait()
    finally:
        if proc.poll() is None:   # interrupted: do not leave a training run behind
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return read_outcome(args, run, returncode, list(tail), time.perf_counter() - start)


def read_outcome(args: argparse.Namespace, run: RunSpec, returncode: int, tail: list[str],
                 wall_s: float | None) -> RunOutcome:
    by_step = read_curves(run.out_dir).get("loss/val_ppl", {})
    curve = [[step * args.micro_batch * args.seq_len, finite(by_step[step])] for step in sorted(by_step)]
    if returncode != 0:
        last = next((line for line in reversed(tail) if line.strip()), "")
        return RunOutcome(None, None, None, curve, f"exit code {returncode}: {last.strip()[:300]}", wall_s)
    result_path = run.out_dir / "result.json"
    if not result_path.exists():
        return RunOutcome(None, None, None, curve, f"no {result_path} after exit code 0", wall_s)
    result = json.loads(result_path.read_text())
    ppl = finite(result["final/val_ppl"])
    skipped = None if ppl is not None else f"non-finite final validation PPL ({result['final/val_ppl']})"
    return RunOutcome(ppl, finite(result["final/val_loss"]), finite(result["final/train_loss"]), curve, skipped,
                      wall_s)


def finite(value: Any) -> float | None:
    """JSON has no NaN: a diverged number is stored as null."""
    return float(value) if value is not None and math.isfinite(float(value)) else None


def write_curves(run_dir: Path) -> None:
    """RUN_DIR/curves.csv from the run's TensorBoard events (tb/): one row per logged step, a column per tag of
    CURVE_TAGS (exact values), empty where the step logged no such value (validation every eval_interval steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})   # 0: keep every point
    events.Reload()
    tags = [t for t in CURVE_TAGS if t in events.Tags()["scalars"]]
    # A reloaded step keeps its last value.
    values = {t: {e.step: e.value for e in events.Scalars(t)} for t in tags}
    steps = sorted({s for by_step in values.values() for s in by_step})
    rows = [",".join(["step", *tags])] + [",".join([str(s), *(repr(values[t][s]) if s in values[t] else ""
                                                              for t in tags)]) for s in steps]
    tmp = run_dir / (CURVES_FILE + ".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    os.replace(tmp, run_dir / CURVES_FILE)


def read_curves(run_dir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of RUN_DIR/curves.csv, written first from tb/ when the run has event files (a run of
    this machine, finished or not); {} for a run with neither."""
    if (run_dir / "tb").is_dir():
        write_curves(run_dir)
    if not (run_dir / CURVES_FILE).is_file():
        return {}
    with open(run_dir / CURVES_FILE, newline="") as f:
        rows = list(csv.DictReader(f))
    tags = [t for t in (rows[0] if rows else {}) if t != "step"]
    return {t: {int(r["step"]): float(r[t]) for r in rows if r[t]} for t in tags}
