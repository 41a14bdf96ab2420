"""Every GPU check of the project in one call (DESIGN s6; issue 15 item 3): tools/gpu_check.sh runs this file.

    tools/gpu_check.sh OUTDIR          # on the GPU machine: one call, under 8 minutes on one H200
    tools/gpu_check.sh --plan OUTDIR   # print the steps, their time limits and commands; run nothing

Steps, each a subprocess (and its children) under its own time limit; the limits add up to under 8 minutes:
  install_wheels    pip install --no-index --find-links .gpu_wheels (tools/gpu_wheels.sh made the folder here)
  install_target    only if that failed (no write access, an externally managed Python): the same wheels unpacked
                    with --no-deps into .gpu_site, which then goes first on PYTHONPATH
  environment       versions and device, and that deepspeed and submitit import
  pytest_gpu        the GPU-marked tests (only the files that hold them)
  train_check       tools/gpu_train_check.py: the real Trainer on NCCL, 60m (vocab 32000), 30 steps with topology
                    refreshes, a checkpoint at 15 and a resume that must continue bit-identically, with the matrix
                    engine's collectives forced at one rank (engine.force_collectives=true)
  bench_layer       bench/layer.py in bf16 on the GPU
  bench_inference   bench/inference.py, 60m and 350m forwards with the 2:4 kernels
  bench_train_60m   bench/train.py, dense AdamW against CHTs 1:4 + TANS (tokens/s ratio, MFU, phases)
  bench_train_350m  the same at 350m
Time limits (issue 25 item 6): each step's limit is its expected seconds on a cold one-H200 machine times MARGIN,
rounded up to 5 s (`BUDGET` holds the figures and where each comes from); the limits, the CUDA probe's and
PACKAGING_S add up to at most 8 minutes, checked before anything runs. Measured on this project's 2-core CPU
machine under load (2026-12-03): `import torch, deepspeed, submitit` + the Trainer 8.5 s; build_model 60m 2.2 s,
350m 8.9 s (one thread); `bench.train model=60m nproc=1` (tiny batches) 41 s wall, of which 27 s to build and
start the first Trainer (DeepSpeed init included), 1 s the second, 5 s a refresh. The GPU parts (CUDA context, the
timed steps) are estimates: no GPU has measured them yet. GPU steps run with NCCL_DEBUG=WARN (unless the caller
set it), so a NCCL failure says why. Any failure (a step that cannot start, a CUDA probe that hangs, an error in
the orchestrator, SIGTERM) still packages what is there, with the error in the summary.

Everything a step writes goes to a scratch folder; what comes back is OUTDIR with three files (the run tool returns
at most 8 files of at most 16 MiB): gpu_check.tar.gz (every step's log and JSON, pytest's junit XML; logs cut to
their last 2 MiB), summary.txt (the table printed last) and gpu_h200.json (the figures in docs/results/ shape:
`chts_1of4_tans_over_dense_adamw` at 350m and the rest, `machine`, `config`). Exit code 1 if any step failed, or
if a step's JSON could not be read (`figures_error`; the files still come back).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu_wheels"
SITE = ROOT / ".gpu_site"
PACKAGES = ("deepspeed==0.19.8", "submitit", "nvidia-ml-py")
BUDGET_S = 480                      # the whole call: 8 minutes
MARGIN = 1.5                        # limit >= 1.5 x the expected seconds
PACKAGING_S = 10                    # figures, summary and tarball after the last step
CUDA_PROBE = ("import torch; print(int(torch.cuda.is_available()))",)
CUDA_PROBE_S = 15                   # import torch + CUDA init (expected ~8 s)
# step -> (expected seconds on a cold one-H200 machine, where the figure comes from)
BUDGET: dict[str, tuple[float, str]] = {
    "install_wheels": (20, "pip install --no-index of ~15 wheels, deepspeed's compiled-free wheel"),
    "install_target": (12, "the same unpacked with --no-deps; runs only when install_wheels failed"),
    "environment": (9, "import torch, deepspeed, submitit: 8.5 s measured on CPU"),
    "pytest_gpu": (30, "pytest start and imports ~10 s, 7 GPU tests on small tensors, first CUDA kernels"),
    "train_check": (50, "imports 9 + first Trainer 27 (measured) + 30+15 steps of 60m + 3 refreshes + a checkpoint"),
    "bench_layer": (20, "imports 5 + bf16 layer cases, each a few ms per call"),
    "bench_inference": (36, "imports 9 + build_model 60m 2.2 s and 350m 8.9 s, dense and sparse, + 2:4 forwards"),
    "bench_train_60m": (50, "41 s measured on CPU at tiny batches (27 s first Trainer) + CUDA init + 16 steps"),
    "bench_train_350m": (70, "imports 9 + first Trainer 27 + 2 x 350m build 8.9 (measured) + CUDA init 5 + "
                             "4 warm-up and 16 timed steps ~10 + a 350m refresh ~5"),
}


def limit_for(name: str) -> int:
    """The step's limit: expected seconds x MARGIN, rounded up to 5 s."""
    return 5 * math.ceil(BUDGET[name][0] * MARGIN / 5)
LOG_TAIL_BYTES = 2 * 1024 * 1024    # each log in the tarball keeps its last 2 MiB
RATIO_ROWS = "dense_adamw,chtsnm_nobranch_1of4_row"
CHTS_ROW = "chtsnm_nobranch_1of4_row"


@dataclass
class Step:
    name: str
    limit_s: int
    argv: list[str]
    what: str
    json: str | None = None          # the JSON the step writes (a file name in the scratch folder)
    needs_cuda: bool = True
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    name: str
    rc: int | None                   # None: not run; 124: timed out
    seconds: float
    limit_s: int
    note: str = ""


def budgeted(name: str, argv: list[str], what: str, **kwargs: Any) -> Step:
    """A step whose limit comes from BUDGET."""
    return Step(name, limit_for(name), argv, what, **kwargs)


def plan(py: str, work: Path) -> list[Step]:
    """The steps of a full check, in order (install_target runs only when install_wheels fails)."""
    gpu_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                       if "pytest.mark.gpu" in p.read_text())
    install_env = {"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    bench_train = [py, "-m", "bench.train", f"rows={RATIO_ROWS}", "steps=8", "warmup=2", "micro_batch=64"]
    return [
        budgeted("install_wheels", [py, "-m", "pip", "install", "--no-index", "--find-links", str(WHEELS),
                                    *PACKAGES], "install the carried wheels, no index", needs_cuda=False,
             env=install_env),
        budgeted("install_target", [py, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(SITE),
                                    *sorted(str(w) for w in WHEELS.glob("*.whl"))],
             "fallback: unpack them into .gpu_site", needs_cuda=False, env=install_env),
        budgeted("environment", [py, "-c", "import torch, deepspeed, submitit; print('torch', torch.__version__, "
                                           "'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__, 'device', "
                                           "torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"],
             "versions, device, imports", needs_cuda=False),
        budgeted("pytest_gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                                f"--junitxml={work / 'pytest_gpu.xml'}", *gpu_files], "GPU-marked tests"),
        budgeted("train_check", [py, "tools/gpu_train_check.py", "--out", str(work / "train_check_runs"),
                                 "--json", str(work / "train_check.json"), "--model", "60m", "--steps", "30",
                                 "--save-at", "15", "--refresh-interval", "10", "engine.force_collectives=true"],
             "Trainer on NCCL: refresh, checkpoint, bit-identical resume", json="train_check.json"),
        budgeted("bench_layer", [py, "-m", "bench.layer", "device=cuda", "dtype=bf16",
                                 "--json", str(work / "bench_layer_gpu.json")], "NMSparseLinear vs nn.Linear, bf16",
             json="bench_layer_gpu.json"),
        budgeted("bench_inference", [py, "-m", "bench.inference", "models=60m,350m", "skip_csr=true",
                                     "--json", str(work / "bench_inference_gpu.json")], "2:4 kernel forwards",
             json="bench_inference_gpu.json"),
        budgeted("bench_train_60m", [*bench_train, "model=60m", "--json", str(work / "bench_train_60m.json")],
             "dense AdamW vs CHTs 1:4 + TANS, 60m", json="bench_train_60m.json"),
        budgeted("bench_train_350m", [*bench_train, "model=350m", "--json", str(work / "bench_train_350m.json")],
             "dense AdamW vs CHTs 1:4 + TANS, 350m", json="bench_train_350m.json"),
    ]


def total_limit_s(steps: list[Step]) -> int:
    """What the check may take at most: every step's limit, the CUDA probe's and the packaging reserve."""
    return sum(s.limit_s for s in steps) + CUDA_PROBE_S + PACKAGING_S


def check_budget(steps: list[Step]) -> None:
    total = total_limit_s(steps)
    if total > BUDGET_S:
        raise ValueError(f"step limits: got {total}s in all ({', '.join(f'{s.name} {s.limit_s}s' for s in steps)}, "
                         f"CUDA probe {CUDA_PROBE_S}s, packaging {PACKAGING_S}s); allowed: at most {BUDGET_S}s")


def run_step(step: Step, log_path: Path, env: dict[str, str], cuda: bool | str) -> Outcome:
    """Run one step in its own session, output to its log; at the limit the whole process group is ended
    (bench_train's ranks included). `cuda` is True, or why there is no device."""
    if step.needs_cuda and cuda is not True:
        return Outcome(step.name, None, 0.0, step.limit_s, f"skipped: {cuda or 'no CUDA device'}")
    argv = step.argv
    # NCCL says nothing about why it failed unless asked; a caller's own NCCL_DEBUG wins.
    gpu_env = {"NCCL_DEBUG": env.get("NCCL_DEBUG", "WARN")} if step.needs_cuda else {}
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, env={**env, **gpu_env, **step.env}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            log.write(f"could not start: {err}\n")
            return Outcome(step.name, 127, time.monotonic() - start, step.limit_s, f"could not start: {err}")
        try:
            rc = proc.wait(timeout=step.limit_s)
            note = ""
        except subprocess.TimeoutExpired:
            _end_group(proc)
            rc, note = 124, f"timed out after {step.limit_s}s"
        except BaseException:   # SIGTERM or ^C of the check itself: the step's processes go with it
            _end_group(proc)
            raise
    return Outcome(step.name, rc, time.monotonic() - start, step.limit_s, note)


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_all(steps: list[Step], work: Path, outcomes: list[Outcome] | None = None) -> list[Outcome]:
    """Every step in order, logs in `work`, each outcome appended to `outcomes` as it ends (so that a caller
    that catches an error still holds the steps that ran); whether CUDA is there is asked (after the installs)
    by the first step that needs it."""
    cuda: bool | str | None = None
    # DeepSpeed on the GPU steps' CUDA accelerator, named rather than detected: tests/conftest.py would otherwise
    # default a GPU test that builds DeepSpeed to the CPU accelerator.
    env = {"DS_ACCELERATOR": "cuda", **os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    outcomes = [] if outcomes is None else outcomes
    for step in steps:
        if step.name == "install_target" and outcomes and outcomes[-1].rc == 0:
            outcomes.append(Outcome(step.name, None, 0.0, step.limit_s, "not needed"))
            continue
        print(f"== {step.name} (limit {step.limit_s}s): {step.what}", flush=True)
        if step.needs_cuda and cuda is None:
            cuda = _cuda_here(env)
        outcome = run_step(step, work / f"{step.name}.log", env, cuda)
        if step.name == "install_target" and outcome.rc == 0:
            env["PYTHONPATH"] = os.pathsep.join([str(SITE), env["PYTHONPATH"]])
        if step.name == "environment" and outcome.rc == 0:
            outcome.note = (work / "environment.log").read_text().splitlines()[-1][:100]
        print(f"   rc={outcome.rc} {outcome.seconds:.0f}s {outcome.note}", flush=True)
        outcomes.append(outcome)
    return outcomes


def _cuda_here(env: dict[str, str]) -> bool | str:
    """True, or why not: a probe that hangs (a wedged driver) or cannot start ends the GPU steps, not the check."""
    try:
        out = subprocess.run([sys.executable, "-c", *CUDA_PROBE], env=env, capture_output=True, text=True,
                             timeout=CUDA_PROBE_S)
    except subprocess.TimeoutExpired:
        return f"the CUDA probe timed out after {CUDA_PROBE_S}s"
    except OSError as err:
        return f"the CUDA probe could not start: {err}"
    if out.returncode != 0:
        return f"the CUDA probe failed (rc {out.returncode}: {out.stderr.strip()[-200:]})"
    return out.stdout.strip() == "1" or "no CUDA device"


def missing_packages(wheels: Path = WHEELS) -> str | None:
    """Why the check cannot start, or None: without carried wheels and without deepspeed installed, every step
    after the installs would fail, each spending device time to say so."""
    if any(wheels.glob("*.whl")) or importlib.util.find_spec("deepspeed") is not None:
        return None
    return (f"no wheels in {wheels} and deepspeed is not installed for {sys.executable}: run tools/gpu_wheels.sh "
            f"on a machine with a package index and carry {wheels.name} with the working tree "
            f"(the device tool: carry=[\"{wheels.name}\"])")


def failed(outcome: Outcome) -> bool:
    """A step that ran and did not exit 0, or a GPU step skipped for want of a GPU (the check then proves
    nothing). install_target 'not needed' is not a failure; a failed install_wheels rescued by it is not either."""
    if outcome.name == "install_wheels":
        return False   # judged by install_target / environment
    if outcome.rc is None:
        return outcome.note.startswith("skipped")
    return outcome.rc != 0


# ---- figures ---------------------------------------------------------------------------------------------------

def _read(work: Path, name: str | None) -> dict | None:
    path = work / name if name else None
    if path is None or not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def train_rows(bench: dict) -> dict[str, dict[str, Any]]:
    """From one bench_train JSON, per row: tokens/s, its ratio to dense AdamW, MFU, and the shares of the step
    taken by the optimizer phase, the backbone rule step (TANS for the CHTs row) and the amortized refresh."""
    rows = {}
    for method, p in bench["phases_s"].items():
        effective = p["step"] + p["refresh"]
        rows[method] = {"tokens_per_s": bench["tokens_per_s"][method],
                        "over_dense_adamw": bench["over_dense_adamw"][method], "mfu": bench["mfu"][method],
                        "optimizer_share_of_step": p["optimizer"] / p["step"],
                        "backbone_step_share_of_step": p["backbone_step"] / p["step"],
                        "refresh_share_of_step": p["refresh"] / effective}
    return rows


def figures(steps: list[Step], outcomes: list[Outcome], work: Path) -> dict[str, Any]:
    """The check's results in docs/results/*.json shape: named figures at the top, then machine and config."""
    data = {s.name: _read(work, s.json) for s in steps if s.json}
    out: dict[str, Any] = {}
    per_size = {size: train_rows(data[f"bench_train_{size}"]) for size in ("60m", "350m")
                if data.get(f"bench_train_{size}")}
    for size, rows in per_size.items():
        suffix = "" if size == "350m" else f"_{size}"   # the target is at 350m
        out[f"chts_1of4_tans_over_dense_adamw{suffix}"] = rows[CHTS_ROW]["over_dense_adamw"]
        out[f"tans_share_of_step_{size}"] = rows[CHTS_ROW]["backbone_step_share_of_step"]
    for size, rows in per_size.items():
        out[f"train_{size}"] = rows
    check = data.get("train_check")
    if check:
        out["resume_bit_identical"] = check["resume_bit_identical"]
        out["train_check"] = {k: check[k] for k in ("losses_identical", "val_loss_identical", "state_hash_identical",
                                                    "refreshes_identical", "max_abs_loss_diff", "refreshes_a",
                                                    "refreshes_b", "seconds_a", "seconds_b", "config")}
    layer = data.get("bench_layer")
    if layer:
        out["layer_fwd_bwd_ratio"] = layer["fwd_bwd_ratio"]
    inference = data.get("bench_inference")
    if inference and "models" in inference.get("gpu", {}):
        out["inference_2of4_speedup"] = {size: m.get("speedup_mean", m.get("skipped"))
                                         for size, m in inference["gpu"]["models"].items()}
    out["steps"] = step_table(outcomes)
    machine = next((d["machine"] for d in data.values() if d and "machine" in d), None)
    out["machine"] = machine
    out["config"] = {
        "command": "tools/gpu_check.sh OUTDIR",
        "steps": {s.name: " ".join(s.argv).replace(str(work), "<scratch>") for s in steps},
        "bench_train": {size: data[f"bench_train_{size}"]["config"] for size in per_size},
        "ratio": "chts_1of4_tans_over_dense_adamw: bench_train's paired tokens/s ratio of CHTs 1:4 + TANS "
                 "(chtsnm_nobranch_1of4_row) to dense AdamW at 350m; _60m: the same at 60m",
        "targets": {"chts_1of4_tans_over_dense_adamw": ">= 0.90 at 350m (paper: 0.75 on an RTX 5080)",
                    "tans_share_of_step_350m": "<= 0.05"},
        "shares": "optimizer_share_of_step = optimizer / step; backbone_step_share_of_step = backbone_step / "
                  "step, which for the CHTs 1:4 + TANS row is tans_share_of_step_<size> (the TANS rule step, "
                  "refresh excluded); refresh_share_of_step = amortized refresh / (step + it) "
                  "(bench/train.py phases, medians)",
    }
    return out


def step_table(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    return {o.name: {"rc": o.rc, "seconds": round(o.seconds, 1), "limit_s": o.limit_s, "note": o.note}
            for o in outcomes}


def figures_or_error(steps: list[Step], outcomes: list[Outcome], work: Path) -> dict[str, Any]:
    """`figures`, or, when a step's JSON is not in the shape it reads, the error and the step table: the logs and
    JSON files still come back in the tarball (a GPU check is not rerun lightly)."""
    try:
        return figures(steps, outcomes, work)
    except Exception as err:   # whatever the JSON holds, the files still come back
        return {"figures_error": f"{type(err).__name__}: {err} (read the step JSON files in the tarball)",
                "steps": step_table(outcomes)}


def summary_table(outcomes: list[Outcome], fig: dict[str, Any]) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = [f"{'step':{width}s}  {'rc':>4s}  {'seconds':>7s}  {'limit':>5s}  note"]
    for o in outcomes:
        rc = "-" if o.rc is None else str(o.rc)
        lines.append(f"{o.name:{width}s}  {rc:>4s}  {o.seconds:7.1f}  {o.limit_s:5d}  {o.note}")
    lines.append("")
    for key in ("check_error", "figures_error", "chts_1of4_tans_over_dense_adamw",
                "chts_1of4_tans_over_dense_adamw_60m",
                "tans_share_of_step_350m", "tans_share_of_step_60m", "resume_bit_identical"):
        if key in fig:
            lines.append(f"{key} = {fig[key]}")
    for size in ("60m", "350m"):
        for method, row in fig.get(f"train_{size}", {}).items():
            cells = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
            lines.append(f"{size} {method}: {cells}")
    if "inference_2of4_speedup" in fig:
        lines.append(f"2:4 inference speedup: {fig['inference_2of4_speedup']}")
    return "\n".join(lines) + "\n"


def package(work: Path, out: Path, table: str, fig: dict[str, Any]) -> list[Path]:
    """OUTDIR/gpu_check.tar.gz (the scratch folder's logs, JSONs and XML; no checkpoints), summary.txt and
    gpu_h200.json."""
    out.mkdir(parents=True, exist_ok=True)
    tarball = out / "gpu_check.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for path in sorted(work.iterdir()):
            if not path.is_file() or path.suffix not in (".log", ".json", ".xml", ".txt"):
                continue
            data = path.read_bytes()
            if path.suffix == ".log" and len(data) > LOG_TAIL_BYTES:
                data = b"[... cut: last 2 MiB kept ...]\n" + data[-LOG_TAIL_BYTES:]
            info = tarfile.TarInfo(f"gpu_check/{path.name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, _Bytes(data))
    (out / "summary.txt").write_text(table)
    (out / "gpu_h200.json").write_text(json.dumps(fig, indent=2) + "\n")
    return [tarball, out / "summary.txt", out / "gpu_h200.json"]


class _Bytes:
    """A file-like view of bytes for tarfile.addfile."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size < 0 else self.pos + size
        chunk, self.pos = self.data[self.pos:end], min(end, len(self.data))
        return chunk


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", help="where the tarball, summary.txt and gpu_h200.json go")
    p.add_argument("--plan", action="store_true", help="print the steps and commands; run nothing")
    args = p.parse_args(argv)
    out = Path(args.outdir).resolve()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        steps = plan(sys.executable, work)
        check_budget(steps)
        if args.plan:
            for s in steps:
                print(f"{s.name:17s} {s.limit_s:4d}s  {' '.join(s.argv)}")
            print(f"limits add up to {total_limit_s(steps)}s with the CUDA probe ({CUDA_PROBE_S}s) and packaging "
                  f"({PACKAGING_S}s), at most {BUDGET_S}s; outputs: {out}/gpu_check.tar.gz, summary.txt, "
                  f"gpu_h200.json")
            return 0
        refusal = missing_packages()
        if refusal:
            out.mkdir(parents=True, exist_ok=True)
            (out / "summary.txt").write_text(f"gpu_check: {refusal}\n")
            print(f"gpu_check: {refusal}", file=sys.stderr)
            return 2
        outcomes: list[Outcome] = []
        error = None
        previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            run_all(steps, work, outcomes)
        except (Exception, KeyboardInterrupt, Terminated) as err:   # package what ran, then say why it stopped
            error = f"{type(err).__name__}: {err}"
            print(f"gpu_check: stopped: {error}", file=sys.stderr, flush=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
        fig = figures_or_error(steps, outcomes, work)
        if error:
            fig = {"check_error": error, **fig}
        table = summary_table(outcomes, fig) if outcomes else f"check_error = {error}\n"
        (work / "summary.txt").write_text(table)
        package(work, out, table, fig)
    print("== summary\n" + table, flush=True)
    return 1 if any(failed(o) for o in outcomes) or "figures_error" in fig or error else 0


class Terminated(Exception):
    """SIGTERM (the caller's own time limit): stop stepping, package what is there."""


def _terminated(signum: int, _frame: Any) -> None:
    raise Terminated(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
