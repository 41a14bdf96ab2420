"""Checkpoint bytes and save/load time of a 1:4 row-wise TANS run against dense AdamW (issue 7 bench).

One process (a world of one), the same model shape and vocab for both runs: `chtsnm_nobranch_1of4_row` (compressed
values, TANS state V and P, CHTs topology) and `dense_adamw` (dense projections, engine-owned AdamW). Each run
trains `--steps` optimizer steps on synthetic tokens (so every optimizer state exists), then the trainer's own
`save()` is timed, and a fresh trainer's `resume()` of that checkpoint (sha256 verification included) is timed.

Figures (top-level JSON keys):
    backbone_ckpt_bytes_over_dense  bytes the checkpoint spends on the backbone matrices, sparse over dense:
                                    backbone/rank*.safetensors (sparse: fp32 master values, codes, TANS V and P,
                                    step counters; dense: fp32 master, exp_avg, exp_avg_sq, step counters) plus the
                                    backbone's tensors in DeepSpeed's module file mp_rank_00_model_states.pt (values
                                    and codes, or the dense weight, in the module dtype: fp32 on CPU, bf16 on GPU).
                                    `details` also gives the ratio without the module copy. Target <= 0.30.
    ckpt_bytes_over_dense           whole checkpoint directory, sparse over dense (the dense side, i.e. embeddings,
                                    head and norms, is the same in both and dominates at vocab 32000)
    save_seconds, load_seconds      the sparse run's save and resume wall time
The module-file share is computed from the module's state_dict (the tensors DeepSpeed pickles), not by
unpickling DeepSpeed's file.

    python tools/bench_checkpoint.py --json out.json            # 60m, vocab 32000
    python tools/bench_checkpoint.py --quick --json out.json    # tiny shape, vocab 32000, for the test suite
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchlib import add_json_arg, machine_info, print_table, write_json

VOCAB = 32000
METHODS = {"sparse": "chtsnm_nobranch_1of4_row", "dense": "dense_adamw"}
MODULE_FILE = "mp_rank_00_model_states.pt"


def world_of_one() -> None:
    """Environment for `deepspeed.init_distributed` in one process, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def synthetic_data(path: Path, seq_len: int, num_samples: int, seed: int = 0) -> str:
    """Uniform random tokens over the 32000 vocab in the data_prep layout (sizes, not quality, are measured)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n in (("train", num_samples * seq_len), ("val", 4 * seq_len)):
        rng.integers(4, VOCAB, size=n, dtype=np.uint16).tofile(path / f"{split}.bin")
        counts[split] = n
    meta = {"vocab_size": VOCAB, "dtype": "uint16", "mode": "packed", "seq_len": seq_len, "num_tokens": counts,
            "bos_id": 1, "eos_id": 2, "pad_id": 3, "unk_id": 0, "tokenizer_sha256": "", "source": "synthetic"}
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


def tree_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(f.stat().st_size for f in path.glob(pattern) if f.is_file())


def module_backbone_bytes(trainer) -> int:
    """Bytes of the backbone cores' entries in the module state_dict DeepSpeed saves (values + codes, or weights),
    in the dtype DeepSpeed cast the module to."""
    return sum(t.numel() * t.element_size() for core in trainer.backbone.values() for t in core.state_dict().values())


def overrides(args: argparse.Namespace, method: str, data_dir: str, work: Path) -> list[str]:
    return [f"model.preset={args.model}", f"model.vocab_size={VOCAB}", f"method.preset={method}",
            f"data.dir={data_dir}", f"data.seq_len={args.seq_len}", f"train.steps={args.steps}", "train.micro_batch=1",
            "train.warmup_steps=1", "train.eval_interval=1000000", "train.eval_samples=1", "train.log_interval=1000000",
            "checkpoint.interval=0", "checkpoint.save_at_end=false", f"checkpoint.dir={work / method / 'ckpt'}",
            f"train.out_dir={work / method / 'run'}"]


def measure(args: argparse.Namespace, method: str, data_dir: str, work: Path) -> dict[str, Any]:
    from distsparse.config import load_config
    from distsparse.train.ds_config import build_ds_config, resolve_dtype
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, overrides(args, method, data_dir, work))
    ds_config = build_ds_config(args.ds_config, cfg)
    trainer = Trainer(cfg, ds_config)
    trainer.train()
    t0 = time.perf_counter()
    path = trainer.save()
    save_s = time.perf_counter() - t0
    module_bytes = module_backbone_bytes(trainer)
    trainer.close()
    del trainer
    gc.collect()
    fresh = Trainer(cfg, ds_config)
    t0 = time.perf_counter()
    fresh.resume(str(path))
    load_s = time.perf_counter() - t0
    assert fresh.step == args.steps, f"resumed at step {fresh.step}, saved at {args.steps}"
    fresh.close()
    del fresh
    gc.collect()
    backbone_files = tree_bytes(path / "backbone")
    return {"method": method, "module_dtype": resolve_dtype(cfg), "backbone_file_bytes": backbone_files,
            "module_backbone_bytes": module_bytes, "backbone_bytes": backbone_files + module_bytes,
            "dense_state_bytes": (path / "dense_state.safetensors").stat().st_size,
            "deepspeed_bytes": sum(f.stat().st_size for f in path.glob("*.pt")),
            "total_bytes": tree_bytes(path), "save_seconds": save_s, "load_seconds": load_s}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="60m", help="model preset (default 60m)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps before the save (default 2)")
    p.add_argument("--ds_config", default=str(Path(__file__).resolve().parent.parent / "configs/ds/zero2.json"))
    p.add_argument("--quick", action="store_true", help="tiny shape (vocab stays 32000), for the test suite")
    add_json_arg(p)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.steps = "tiny", 16, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import deepspeed
    import torch
    world_of_one()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        work = Path(tmp)
        data_dir = synthetic_data(work / "data", args.seq_len, num_samples=8 * args.steps)
        runs = {key: measure(args, method, data_dir, work) for key, method in METHODS.items()}
    sparse, dense = runs["sparse"], runs["dense"]
    result = {
        "backbone_ckpt_bytes_over_dense": sparse["backbone_bytes"] / dense["backbone_bytes"],
        "ckpt_bytes_over_dense": sparse["total_bytes"] / dense["total_bytes"],
        "save_seconds": sparse["save_seconds"],
        "load_seconds": sparse["load_seconds"],
        "machine": machine_info(),
        "config": {"model": args.model, "vocab_size": VOCAB, "seq_len": args.seq_len, "steps": args.steps,
                   "world_size": 1, "methods": METHODS, "module_dtype": sparse["module_dtype"],
                   "ds_config": args.ds_config, "quick": args.quick},
        "details": {"backbone_files_only_over_dense": sparse["backbone_file_bytes"] / dense["backbone_file_bytes"],
                    "runs": runs},
    }
    if args.json:
        write_json(args.json, result)
    rows = [[key, r["backbone_file_bytes"], r["module_backbone_bytes"], r["dense_state_bytes"], r["deepspeed_bytes"],
             r["total_bytes"], r["save_seconds"], r["load_seconds"]] for key, r in runs.items()]
    print_table(["run", "backbone files B", "module backbone B", "dense_state B", "deepspeed B", "total B", "save s",
                 "load s"], rows)
    print()
    print_table(["figure", "value"], [[k, result[k]] for k in ("backbone_ckpt_bytes_over_dense",
                                                                "ckpt_bytes_over_dense", "save_seconds",
                                                                "load_seconds")]
                + [["backbone_files_only_over_dense", result["details"]["backbone_files_only_over_dense"]]])
    return result


if __name__ == "__main__":
    main()
