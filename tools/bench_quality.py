"""Quality benchmark (issue 6 item 4): train several methods on the same text, rank them by validation PPL.

    python tools/bench_quality.py --data data/pydocs4k --methods dense_adamw,chts24_1of4_row,chtsnm_1of4_row \\
        --model small_tied --steps 1500 --json runs/quality/quality.json --plot runs/quality/quality.png \\
        [--lr-sweep chtsnm_1of4_row [--lr-scales 0.5,1,2] [--dense-lr-scales 1,2,4] [--branch-lr-scales 0.5,1,2]
         [--sweep-steps 1500]] \\
        [--force] [--nproc 1] [--eval-points 10] [--out-root runs/quality]

Every method is one run of launch/pretrain.py in a subprocess (plain `python` for one process, the `deepspeed`
launcher for --nproc N), all with the same model, seed, data order and token budget: the global batch
(--micro-batch sequences of --seq-len tokens, split over the ranks) and the step count are shared, so the
sampler hands every method the same samples in the same order (distsparse/data/sampler.py). Validation PPL is
token-weighted (the trainer's `loss/val_ppl`), evaluated every steps // K steps and at the last step, so every
method has its evaluation points at the same token counts. The curve is read back from the run's curves.csv
(its logged losses, validation PPL and gradient norm per step, written from its TensorBoard events: what
docs/results keeps of a run beside config.json and result.json); the final numbers from its result.json.

The table ranks the methods by final PPL, with the ratio to `dense_adamw` and to the CHTs24 run of the same
sparsity and layout (`chts24_{N}of{M}_{row|block}`, parsed from the preset name's suffix), where present.

Resumable per method: the JSON is rewritten atomically after every method, and a method that already has a
result there is skipped unless --force, so a long comparison can run in the background in parts (results of
a JSON written under another comparison config are refused, not mixed). A method whose run failed is recorded
with "skipped": reason, the comparison goes on, and the next invocation retries it.

LR sweep (--lr-sweep): for the named methods, a 2-D grid: every --lr-scales factor (default 0.5x, 1x, 2x) of the
preset's backbone `method.lr` with every --dense-lr-scales factor (default 0.5x, 1x, 2x) of the dense-side
`train.lr` (embeddings, norms, head, branches), one run per pair on --sweep-steps steps (default 1/4 of the steps,
with the LR schedule compressed to that length), then the full run at the pair with the lowest final PPL. The two
rates are swept independently because they want different values: how well the dense side is tuned must not
decide a comparison of backbones. Short sweeps are cheap but biased towards high LRs (a high LR wins early and
loses in the schedule's tail); with --sweep-steps equal to --steps every sweep point is a full run, evaluated at
the comparison's token counts, and the best one is the method's result (no extra run). The JSON records every
point, the chosen pair and whether it lies on the grid's edge (then the grid should be widened).

Branch rate (--branch-lr-scales, issue 28): a third axis for the swept methods that have a branch: every factor of
the preset's dense-side `train.lr` becomes `method.branch_lr`, the branch's own DeepSpeed group (one run per triple,
directories `sweep_b<b>_d<d>_r<r>`). It is a multiple of the preset's train.lr, not of the point's, so the branch
rate is swept independently of the dense side's, as the other two are of each other. Methods without a branch, and
every method without the flag, keep the preset's method.branch_lr (null: the branch on train.lr, the paper's coupling).

A run whose directory already holds result.json and a config.json equal to the run's resolved config (all but
`train.out_dir` and the checkpoint and logging settings) is read back, not rerun (unless --force): an interrupted full-length sweep resumes at its first
missing point. A finished run there under another config is refused, naming the keys that differ (--force
replaces it): retraining would delete it. The refusal comes before anything trains, except for the full run
after a short sweep, whose rates are known only when its sweep is done. The DeepSpeed JSON is not part of that
config: give runs under another --ds-config their own --out-root. A run writes no checkpoint unless --keep-checkpoint
(then one, at its end, in RUN_DIR/checkpoints: branch magnitudes and exports can be examined later).

A whole protocol in stages, on a SLURM cluster or here (`--plan`, its own options: tools/quality_plan.py):

    python tools/bench_quality.py --plan paper_60m --data data/c4_60m --root runs/paper_60m --executor slurm \
        --partition gpu --account proj --time 180
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
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import machine_info, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_DENSE = "dense_adamw"
DEFAULT_LR_SCALES = "0.5,1,2"
SWEEP_STEP_FRACTION = 4          # default sweep runs train steps // 4 steps
_SPARSITY_SUFFIX = re.compile(r"_(\d+)of(\d+)_(row|block)$")
# Settings that make two results comparable; a JSON written under other values is refused, not extended.
COMPARED_KEYS = ("data", "model", "steps", "micro_batch", "seq_len", "eval_interval", "eval_samples", "seed",
                 "warmup_steps", "ds_config", "overrides")
LOG_TAIL_LINES = 30              # lines of a failed run's output kept for its "skipped" reason


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="prepared data directory (data_prep; its vocab sizes the model)")
    p.add_argument("--methods", required=True, help="comma-separated method presets (configs/method/*.yaml)")
    p.add_argument("--model", default="small", help="model preset (configs/model/*.yaml; default small)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps per method")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per optimizer step over all ranks (default 8; each rank takes 1/nproc)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--eval-points", type=int, default=10,
                   help="K: evaluate every steps // K steps and at the last step (default 10)")
    p.add_argument("--eval-samples", type=int, default=256,
                   help="validation sequences per evaluation, 0 for all (default 256)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order seed (default 0)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="LR warmup steps (default: the trainer's train.warmup_steps)")
    p.add_argument("--lr-sweep", default="", metavar="METHOD,...",
                   help="methods to tune first: one run per pair of a --lr-scales factor of the preset's backbone "
                        "lr (method.lr) and a --dense-lr-scales factor of the dense-side lr (train.lr), each on "
                        "--sweep-steps steps; the full run then uses the pair with the lowest final PPL")
    p.add_argument("--lr-scales", default=DEFAULT_LR_SCALES, metavar="S,...",
                   help=f"backbone LR (method.lr) factors of the sweep (default {DEFAULT_LR_SCALES})")
    p.add_argument("--dense-lr-scales", default=DEFAULT_LR_SCALES, metavar="S,...",
                   help=f"dense-side LR (train.lr) factors of the sweep (default {DEFAULT_LR_SCALES})")
    p.add_argument("--branch-lr-scales", default="", metavar="S,...",
                   help="branch LR (method.branch_lr) factors of the preset's train.lr: a third sweep axis for the "
                        "swept methods with a branch (default: none, the preset's method.branch_lr)")
    p.add_argument("--sweep-steps", type=int, default=None,
                   help=f"steps per sweep run (default steps // {SWEEP_STEP_FRACTION}); equal to --steps, the "
                        "best sweep run is the method's result")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (repeatable), e.g. --set train.grad_clip=0.5")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks per run (default 1: plain python; N > 1 uses the deepspeed launcher)")
    p.add_argument("--ds-config", default="configs/ds/zero2.json",
                   help="DeepSpeed JSON, relative to the repository root (default ZeRO-2)")
    p.add_argument("--out-root", default="runs/quality",
                   help="run directories go to OUT_ROOT/METHOD/{full,sweep_x0.5,...} (default runs/quality)")
    p.add_argument("--json", required=True, metavar="PATH", help="results JSON (read first: finished methods skip)")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of validation PPL against training tokens")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="keep each run's final checkpoint in RUN_DIR/checkpoints (default: none is written; the "
                        "checkpoint settings are not part of the config a finished run is read back by)")
    p.add_argument("--force", action="store_true",
                   help="rerun methods that already have a result in the JSON, and runs finished in --out-root")
    args = p.parse_args(argv)
    args.methods = _split_names(args.methods)
    args.lr_sweep = _split_names(args.lr_sweep)
    args.lr_scales = _parse_scales(args.lr_scales, "--lr-scales")
    args.dense_lr_scales = _parse_scales(args.dense_lr_scales, "--dense-lr-scales")
    args.branch_lr_scales = _parse_scales(args.branch_lr_scales, "--branch-lr-scales") \
        if args.branch_lr_scales.strip() else []
    if args.sweep_steps is None:
        args.sweep_steps = args.steps // SWEEP_STEP_FRACTION
    args.out_root = str(Path(args.out_root).resolve())   # the subprocess runs in the repository root
    _check_args(args)
    return args


def _split_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _parse_scales(text: str, flag: str) -> list[float]:
    try:
        scales = [float(s) for s in _split_names(text)]
    except ValueError:
        scales = []
    if not scales or any(not math.isfinite(s) or s <= 0 for s in scales) or len(set(scales)) != len(scales):
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


# ---- one training run ------------------------------------------------------------------------------------

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
    from distsparse.config import load_config
    cfg = load_config(None, [*overrides, f"method.preset={method}"])
    return cfg.method.lr, cfg.train.lr


def has_branch(method: str, overrides: list[str]) -> bool:
    from distsparse.config import load_config
    return load_config(None, [*overrides, f"method.preset={method}"]).method.branch.kind != "none"


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
    return [launcher, "--num_gpus", str(args.nproc), "--master_port", str(_free_port()), *entry, *overrides]


def _free_port() -> int:
    # The launcher's default port 29500 collides with any other DeepSpeed job on the machine.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolved_config(args: argparse.Namespace, run: RunSpec) -> dict:
    """The config run.out_dir's config.json will hold after this run, without train.out_dir and the sections that
    change no number (checkpointing, logging)."""
    from distsparse.config import RESULT_NEUTRAL_SECTIONS, config_to_dict, load_config
    config = json.loads(json.dumps(config_to_dict(load_config(None, run_overrides(args, run)))))
    config["train"].pop("out_dir")
    for section in RESULT_NEUTRAL_SECTIONS:
        config.pop(section)
    return config


def _earlier_config(run: RunSpec) -> dict | None:
    """The config of the run that finished in run.out_dir (without train.out_dir); None when none did."""
    if not (run.out_dir / "result.json").is_file() or not (run.out_dir / "config.json").is_file():
        return None
    from distsparse.config import RESULT_NEUTRAL_SECTIONS, with_added_keys
    found = with_added_keys(json.loads((run.out_dir / "config.json").read_text()))   # runs of an older checkout
    found.get("train", {}).pop("out_dir", None)
    for section in RESULT_NEUTRAL_SECTIONS:
        found.pop(section, None)
    return found


def finished_earlier(args: argparse.Namespace, run: RunSpec) -> bool:
    """True when run.out_dir holds the result of a run with this run's resolved config (all but its out_dir)."""
    found = None if args.force else _earlier_config(run)
    return found is not None and found == _resolved_config(args, run)


class RunInTheWay(ValueError):
    """A run directory holds a finished run of another config."""


def refuse_to_replace(args: argparse.Namespace, run: RunSpec) -> None:
    """Raise RunInTheWay, naming the keys that differ, when run.out_dir holds a finished run of another config:
    retraining would delete a result that may be the only copy (an hour of CPU). --force replaces it."""
    found = None if args.force else _earlier_config(run)
    if found is None:
        return
    expected = _resolved_config(args, run)
    if found == expected:
        return
    from distsparse.utils import config_differences
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
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu" if not _cuda_available() else "cuda")
    env["PYTHONUNBUFFERED"] = "1"
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    start = time.perf_counter()
    proc = subprocess.Popen(run_command(args, run), cwd=ROOT, env=env, stdout=subprocess.PIPE,
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
    tokens_per_step = args.micro_batch * args.seq_len
    curve = read_curve(run.out_dir, tokens_per_step)
    if returncode != 0:
        last = next((line for line in reversed(tail) if line.strip()), "")
        return RunOutcome(None, None, None, curve, f"exit code {returncode}: {last.strip()[:300]}", wall_s)
    result_path = run.out_dir / "result.json"
    if not result_path.exists():
        return RunOutcome(None, None, None, curve, f"no {result_path} after exit code 0", wall_s)
    result = json.loads(result_path.read_text())
    ppl = _finite(result["final/val_ppl"])
    skipped = None if ppl is not None else f"non-finite final validation PPL ({result['final/val_ppl']})"
    return RunOutcome(ppl, _finite(result["final/val_loss"]), _finite(result["final/train_loss"]), curve, skipped,
                      wall_s)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _finite(value: Any) -> float | None:
    """JSON has no NaN: a diverged number is stored as null."""
    return float(value) if value is not None and math.isfinite(float(value)) else None


CURVES_FILE = "curves.csv"
CURVE_TAGS = ("loss/train", "loss/val", "loss/val_ppl", "optim/grad_norm")   # what the README's figures redraw


def write_curves(run_dir: Path) -> None:
    """RUN_DIR/curves.csv from the run's TensorBoard events (tb/): one row per logged step, a column per tag of
    CURVE_TAGS, empty where the step logged no such value (validation every eval_interval steps). The CSV is what
    docs/results keeps of a run's curves; its event files stay in runs/."""
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


def read_curve(run_dir: Path, tokens_per_step: int) -> list[list[float]]:
    """[[tokens, val_ppl], ...] of the run's `loss/val_ppl`, in step order (a diverged value as None)."""
    by_step = read_curves(run_dir).get("loss/val_ppl", {})
    return [[step * tokens_per_step, _finite(by_step[step])] for step in sorted(by_step)]


# ---- one method ------------------------------------------------------------------------------------------

def branch_scales(args: argparse.Namespace, method: str) -> list[float | None]:
    """The branch-rate axis of `method`'s sweep: --branch-lr-scales for a method with a branch, else [None]."""
    return list(args.branch_lr_scales) if args.branch_lr_scales and has_branch(method, base_overrides(args)) \
        else [None]


def _point_name(b: float, d: float, r: float | None) -> str:
    return f"b{b:g}_d{d:g}" + ("" if r is None else f"_r{r:g}")


def _point_key(b: float, d: float, r: float | None) -> tuple[float, ...]:
    return (b, d) if r is None else (b, d, r)


def sweep_specs(args: argparse.Namespace, method: str) -> dict[tuple[float, ...], RunSpec]:
    """The runs of `method`'s LR sweep, by (backbone scale, dense-side scale[, branch scale])."""
    lr, dense_lr = preset_lrs(method, base_overrides(args))
    full_length = args.sweep_steps == args.steps
    # A full-length point may be the result, so it is evaluated at the comparison's token counts.
    sweep_eval = args.steps // args.eval_points if full_length else args.sweep_steps
    return {_point_key(b, d, r): RunSpec(f"{method} {_point_name(b, d, r).replace('_', ' ')}", method, args.sweep_steps,
                               sweep_eval, lr * b, dense_lr * d, Path(args.out_root) / method /
                               f"sweep_{_point_name(b, d, r)}", None if r is None else dense_lr * r)
            for b in args.lr_scales for d in args.dense_lr_scales for r in branch_scales(args, method)}


def full_spec(args: argparse.Namespace, method: str, scale: float, dense_scale: float,
              branch_scale: float | None = None) -> RunSpec:
    """The full-length run of `method` at `scale` x its preset's method.lr and `dense_scale` x train.lr (and
    method.branch_lr = `branch_scale` x train.lr, unless None: the preset's)."""
    lr, dense_lr = preset_lrs(method, base_overrides(args))
    return RunSpec(method, method, args.steps, args.steps // args.eval_points, lr * scale, dense_lr * dense_scale,
                   Path(args.out_root) / method / "full", None if branch_scale is None else dense_lr * branch_scale)


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
            chosen = outcomes[_point_key(scale, dense_scale, branch_scale)]
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


def sparsity_suffix(method: str) -> str | None:
    """`_1of4_row` of `chtsnm_1of4_row`; None for a dense preset."""
    match = _SPARSITY_SUFFIX.search(method)
    return match.group(0) if match else None


def reference_ratios(methods: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Per method: final PPL over dense_adamw's and over chts24 of the same sparsity and layout (None if absent)."""
    def ppl(name: str | None) -> float | None:
        entry = methods.get(name) if name else None
        return entry["final_ppl"] if entry else None

    out = {}
    for name, entry in methods.items():
        own, dense = entry["final_ppl"], ppl(REFERENCE_DENSE)
        suffix = sparsity_suffix(name)
        chts = ppl(f"chts24{suffix}") if suffix else None
        out[name] = {"vs_dense": own / dense if own and dense else None,
                     "vs_chts24": own / chts if own and chts else None}
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
        import quality_plan   # a protocol in stages (configs/plans/): its own options
        return quality_plan.main(argv)
    try:
        args = parse_args(argv)
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
