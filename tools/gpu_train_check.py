"""The real Trainer on the launch's device (NCCL on a GPU, gloo on CPU) for a few dozen steps, with topology
refreshes, a checkpoint and a resume that must continue bit-identically (issue 15 item 3; run by
tools/gpu_check.sh, and at tiny size by the CPU test suite).

    run A   steps 1..N from scratch, a checkpoint at step K (checkpoint.interval=K)
    run B   a new Trainer resumed from A's step-K checkpoint, steps K+1..N

Passes when B's per-step training losses, its final validation loss and the hash of its final state (module
state_dict: values, codes, dense side; matrix engine state_dict: fp32 masters and rule state) equal A's exactly.
`method.topology.update_interval` is small so that refreshes fall on both sides of K. Deterministic kernels are
requested (torch.use_deterministic_algorithms, warn_only, and CUBLAS_WORKSPACE_CONFIG) so that a difference is a
resume defect, not an atomic-add race; attention runs on SDPA's math backend, as flash and memory-efficient
attention keep their non-deterministic backward (atomic dQ accumulation) when determinism is only warned about.
The data is a synthetic token stream (uniform tokens, bench/synthetic.py) written on the spot at the model's
vocabulary (32000 for the named sizes).

    python tools/gpu_train_check.py --out DIR --json check.json [--model 60m] [--steps 30] [--save-at 15] \\
        [key=value ...]        # e.g. engine.force_collectives=true
Launch: plain python (a world of one), or any launcher distsparse/cli/launch_env.py knows; rank 0 writes the JSON.
Exit code 0 when the continuation is bit-identical, 1 when not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # bench/ of the checkout: the benchmarks' synthetic data writer

from bench.synthetic import write_synthetic_data  # noqa: E402
from distsparse.report import machine_info, print_table, write_json  # noqa: E402
METHOD = "chtsnm_nobranch_1of4_row"   # CHTs 1:4 + TANS: backbone rule state and topology refreshes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="scratch folder for the two runs (checkpoints, TensorBoard)")
    p.add_argument("--json", default=None, help="write the result here (rank 0)")
    p.add_argument("--model", default="60m", help="model preset (default 60m)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the synthetic data (default 32000)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of run A (default 30)")
    p.add_argument("--save-at", type=int, default=15, help="checkpoint step K that run B resumes from (default 15)")
    p.add_argument("--refresh-interval", type=int, default=10, help="method.topology.update_interval (default 10)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("overrides", nargs="*", help="more key=value overrides for both runs")
    args = p.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        p.error(f"--save-at: got {args.save_at}; allowed: 1 .. {args.steps - 1} (--steps {args.steps})")
    return args


DETERMINISM = ("torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG, SDPA math "
               "backend only (flash, memory-efficient and cuDNN attention off)")


def deterministic_kernels() -> None:
    """Kernels that give the same bits for the same inputs, so that runs A and B agree where they should."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode also fills every torch.empty with NaN by default: DeepSpeed's large flat buckets make
    # that seconds per step, and the kernels stay deterministic without it.
    torch.utils.deterministic.fill_uninitialized_memory = False
    # With warn_only, flash and memory-efficient attention only warn and keep their atomic dQ accumulation in the
    # backward (torch docs, notes/randomness: CUDA SDPA); the math backend is deterministic (60m at 256 tokens:
    # its S x S scores are small).
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def run_config(args: argparse.Namespace, data: str, out: Path, extra: list[str]):
    from distsparse.config import load_config
    return load_config(None, [f"model.preset={args.model}", f"method.preset={METHOD}",
                              f"model.vocab_size={args.vocab}", f"data.dir={data}", f"data.seq_len={args.seq_len}",
                              f"train.micro_batch={args.micro_batch}", "train.grad_accum=1",
                              f"train.steps={args.steps}", f"train.warmup_steps={max(1, args.steps // 10)}",
                              f"method.topology.update_interval={args.refresh_interval}",
                              f"train.eval_interval={args.steps}", "train.eval_samples=16", "train.log_interval=1",
                              "checkpoint.save_at_end=false", f"train.out_dir={out}", *args.overrides, *extra])


def state_hash(trainer) -> str:
    """sha256 over the module's state_dict and the matrix engine's state_dict, in name order, as raw bytes."""
    digest = hashlib.sha256()
    tensors = {f"module/{k}": v for k, v in trainer.engine.module.state_dict().items()}
    for name, state in trainer.matrix.state_dict().items():
        tensors.update({f"matrix/{name}/{k}": v for k, v in state.items()})
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().cpu()
        digest.update(key.encode())
        digest.update(str(t.dtype).encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def train(cfg, ds_config: dict) -> dict:
    """Run one Trainer to the end; per-step training loss and refresh steps, the final state's hash."""
    from distsparse.train.trainer import Trainer

    trainer = Trainer(cfg, ds_config)
    losses: dict[int, float] = {}
    refreshes: list[int] = []

    def record(step: int, report) -> None:
        losses[step] = report.metrics["loss/train"]
        if any(k.startswith("topology/") for k in report.metrics):
            refreshes.append(step)

    start = time.perf_counter()
    try:
        result = trainer.train(on_step=record)
        seconds = time.perf_counter() - start
        digest = state_hash(trainer)
        device = str(trainer.device)
    finally:
        trainer.close()
    return {"losses": losses, "refreshes": refreshes, "val_loss": result.val_loss, "hash": digest,
            "seconds": seconds, "device": device, "first_step": min(losses) if losses else None}


def compare(a: dict, b: dict, save_at: int) -> dict:
    """Run B against run A over the steps B ran."""
    steps = sorted(b["losses"])
    diffs = [abs(a["losses"][s] - b["losses"][s]) for s in steps if s in a["losses"]]
    losses_identical = (steps == [s for s in sorted(a["losses"]) if s > save_at]
                        and all(a["losses"][s] == b["losses"][s] for s in steps))
    out = {
        "losses_identical": losses_identical,
        "val_loss_identical": a["val_loss"] == b["val_loss"],
        "state_hash_identical": a["hash"] == b["hash"],
        "refreshes_identical": [s for s in a["refreshes"] if s > save_at] == b["refreshes"],
        "max_abs_loss_diff": max(diffs) if diffs else None,
    }
    out["resume_bit_identical"] = all(out[k] for k in ("losses_identical", "val_loss_identical",
                                                       "state_hash_identical", "refreshes_identical"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # read when cuBLAS starts, at the first GEMM
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    from distsparse.cli import launch_env
    from distsparse.train.deepspeed.config import build_ds_config, resolve_dtype
    env = launch_env.resolve_here()
    device = launch_env.start(env)
    logging.info(launch_env.describe(env, device))
    deterministic_kernels()

    out = Path(args.out)
    if env.rank == 0 and out.exists():
        shutil.rmtree(out)
    tokens = (args.steps + 2) * args.micro_batch * args.seq_len * env.world_size
    data = write_synthetic_data(out / "data", args.vocab, tokens, val_tokens=16 * args.seq_len) \
        if env.rank == 0 else str(out / "data")
    from distsparse import dist as ddist
    ddist.barrier()

    cfg_a = run_config(args, data, out / "a", [f"checkpoint.interval={args.save_at}"])
    ds_config = build_ds_config(ROOT / "configs/ds/zero2.json", cfg_a)
    run_a = train(cfg_a, ds_config)
    resume_from = out / "a" / "checkpoints" / f"step{args.save_at:08d}"
    cfg_b = run_config(args, data, out / "b", [f"checkpoint.resume={resume_from}"])
    run_b = train(cfg_b, build_ds_config(ROOT / "configs/ds/zero2.json", cfg_b))
    verdict = compare(run_a, run_b, args.save_at)

    if env.rank == 0:
        payload = {
            **verdict,
            "steps": args.steps, "resumed_at": args.save_at, "refreshes_a": run_a["refreshes"],
            "refreshes_b": run_b["refreshes"], "losses_a": run_a["losses"], "losses_b": run_b["losses"],
            "val_loss_a": run_a["val_loss"], "val_loss_b": run_b["val_loss"], "state_hash_a": run_a["hash"],
            "state_hash_b": run_b["hash"], "seconds_a": run_a["seconds"], "seconds_b": run_b["seconds"],
            "machine": machine_info(),
            "config": {"model": args.model, "method": METHOD, "vocab_size": args.vocab, "world_size": env.world_size,
                       "launch": env.source, "device": run_a["device"], "dtype": resolve_dtype(cfg_a),
                       "micro_batch": args.micro_batch, "seq_len": args.seq_len, "grad_accum": 1,
                       "update_interval": args.refresh_interval, "overrides": args.overrides,
                       "ds_config": "configs/ds/zero2.json via build_ds_config",
                       "deterministic_algorithms": DETERMINISM,
                       "data": "synthetic uniform tokens"},
        }
        if args.json:
            write_json(args.json, payload)
        print_table(["check", "value"], [[k, verdict[k]] for k in verdict] +
                    [["refresh steps (A)", run_a["refreshes"]], ["refresh steps (B)", run_b["refreshes"]],
                     ["run A s", run_a["seconds"]], ["run B s", run_b["seconds"]]])
    ddist.barrier()
    return 0 if verdict["resume_bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
