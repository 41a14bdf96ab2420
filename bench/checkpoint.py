"""Checkpoint bytes and save/load time of a 1:4 row-wise TANS run against dense AdamW (issue 7): one rank, the same
shape and vocab for `chtsnm_nobranch_1of4_row` and `dense_adamw`, each trained a few steps (every optimizer state
exists), then the trainer's own `save()` and a fresh trainer's `resume()` timed. What the backbone's bytes are (its
files plus its share of DeepSpeed's module file): docs/benchmarks.md. Target: backbone bytes sparse / dense <= 0.30.

    python -m bench.checkpoint --json out.json            # 60m, vocab 32000
    python -m bench.checkpoint --quick --json out.json    # tiny shape, vocab 32000, for the test suite
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core import Figure, Settings, finish, parse
from bench.ranks import on_ranks
from bench.synthetic import write_synthetic_data
from bench.trainers import DS_CONFIG, build_trainer

VOCAB = 32000
METHODS = {"sparse": "chtsnm_nobranch_1of4_row", "dense": "dense_adamw"}
TARGET = 0.30


@dataclass
class CheckpointSettings(Settings):
    model: str = "60m"
    seq_len: int = 64
    steps: int = 2          # optimizer steps before the save
    QUICK = {"model": "tiny", "seq_len": 16, "steps": 1}

    def __post_init__(self) -> None:
        self.at_least(seq_len=1, steps=1)


def tree_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(f.stat().st_size for f in path.glob(pattern) if f.is_file())


def module_backbone_bytes(trainer) -> int:
    """Bytes of the backbone cores' entries in the module state_dict DeepSpeed saves (values + codes, or weights),
    in the dtype DeepSpeed cast the module to (computed from the module, not by unpickling DeepSpeed's file)."""
    return sum(t.numel() * t.element_size() for core in trainer.backbone.values() for t in core.state_dict().values())


def measure(s: CheckpointSettings, method: str, data_dir: str, work: Path) -> dict[str, Any]:
    from distsparse.train.deepspeed.config import resolve_dtype

    overrides = [f"model.preset={s.model}", f"model.vocab_size={VOCAB}", f"method.preset={method}",
                 f"data.dir={data_dir}", f"data.seq_len={s.seq_len}", f"train.steps={s.steps}", "train.micro_batch=1",
                 "train.warmup_steps=1", "train.eval_interval=1000000", "train.eval_samples=1",
                 "train.log_interval=1000000", "checkpoint.interval=0", "checkpoint.save_at_end=false",
                 f"checkpoint.dir={work / method / 'ckpt'}", f"train.out_dir={work / method / 'run'}"]
    trainer = build_trainer(overrides)
    trainer.train()
    t0 = time.perf_counter()
    path = trainer.save()
    save_s = time.perf_counter() - t0
    module_bytes, dtype = module_backbone_bytes(trainer), resolve_dtype(trainer.cfg)
    trainer.close()
    del trainer
    gc.collect()
    fresh = build_trainer(overrides)
    t0 = time.perf_counter()
    fresh.resume(str(path))
    load_s = time.perf_counter() - t0
    assert fresh.step == s.steps, f"resumed at step {fresh.step}, saved at {s.steps}"
    fresh.close()
    del fresh
    gc.collect()
    backbone_files = tree_bytes(path / "backbone")
    return {"method": method, "module_dtype": dtype, "backbone_file_bytes": backbone_files,
            "module_backbone_bytes": module_bytes, "backbone_bytes": backbone_files + module_bytes,
            "dense_state_bytes": (path / "dense_state.safetensors").stat().st_size,
            "deepspeed_bytes": sum(f.stat().st_size for f in path.glob("*.pt")),
            "total_bytes": tree_bytes(path), "save_seconds": save_s, "load_seconds": load_s}


def _rank_main(rank: int, world_size: int, s: CheckpointSettings) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp:
        work = Path(tmp)
        data_dir = write_synthetic_data(work / "data", VOCAB, 8 * s.steps * s.seq_len)
        return {key: measure(s, method, data_dir, work) for key, method in METHODS.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    s, json_path = parse(CheckpointSettings, argv, __doc__.split("\n\n")[0])
    import torch

    runs = on_ranks(None, 1, _rank_main, s, cuda=torch.cuda.is_available())[0]
    sparse, dense = runs["sparse"], runs["dense"]
    files_only = sparse["backbone_file_bytes"] / dense["backbone_file_bytes"]
    figures = [Figure("backbone_ckpt_bytes_over_dense", sparse["backbone_bytes"] / dense["backbone_bytes"], TARGET),
               Figure("ckpt_bytes_over_dense", sparse["total_bytes"] / dense["total_bytes"]),
               Figure("save_seconds", sparse["save_seconds"]), Figure("load_seconds", sparse["load_seconds"])]
    config = {"model": s.model, "vocab_size": VOCAB, "seq_len": s.seq_len, "steps": s.steps, "world_size": 1,
              "methods": METHODS, "module_dtype": sparse["module_dtype"], "ds_config": str(DS_CONFIG),
              "quick": s.quick}
    rows = [[key, r["backbone_file_bytes"], r["module_backbone_bytes"], r["dense_state_bytes"], r["deepspeed_bytes"],
             r["total_bytes"], r["save_seconds"], r["load_seconds"]] for key, r in runs.items()]
    return finish(json_path, figures, {"details": {"backbone_files_only_over_dense": files_only, "runs": runs}},
                  config, [(["run", "backbone files B", "module backbone B", "dense_state B", "deepspeed B",
                             "total B", "save s", "load s"], rows)],
                  f"{s.model}, vocab {VOCAB}: backbone_files_only_over_dense {files_only:.3f}")


if __name__ == "__main__":
    main()
