"""Loading a model to evaluate, and the perplexity command (`python -m distsparse.eval.perplexity`).

    python -m distsparse.eval.perplexity CKPT_OR_HF_DIR --data DIR [--split val] [--seq-len N] [--max-samples N]
        [--batch-size N] [--device cpu|cuda] [--dtype fp32|bf16] [--json PATH]

`load_model(path)` accepts either
- a Hugging Face folder (config.json + weights, e.g. tools/export_hf.py's output): `AutoModelForCausalLM`;
- a project checkpoint: a step directory holding manifest.json, or a checkpoint root holding `latest`. The training
  model is rebuilt from the manifest's resolved config (`build_model`), its backbone gets the fp32 masters and codes
  of backbone/rank*.safetensors (`CheckpointManager.load_backbone`, by name, whatever rank owned them) and its dense
  side the "<param>::master" entries of dense_state.safetensors. Only project files are read, no DeepSpeed pickle
  (DESIGN decision 6), and the model is the training model itself, so input-dependent branches (CoMoLoRA,
  Prod-Gate) evaluate as trained (DESIGN decision 13).
Input permutations (learned or random) load with their hardening state from the checkpoint's permutation registry
(registry.safetensors), so a ShuffleSparse model evaluates as trained.

The PPL is token-weighted over every scored target token of the split (perplexity.py); in `truncate_pad` data the
pad positions carry label -100 and are not scored (DESIGN s6 data modes).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from distsparse.data import TokenDataset, collate, load_meta, validation_batches
from distsparse.eval.perplexity import loss_sums, perplexity
from distsparse.eval.checkpoint_model import load_trained_model
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class EvalModel:
    model: nn.Module              # eval mode, fp32, on CPU
    source: str                   # "hf" | "checkpoint"
    path: Path                    # the folder given, or the checkpoint step directory found under it
    seq_len: int | None           # the training sequence length (checkpoints record it; HF folders do not)
    tokenizer_dir: Path | None    # an AutoTokenizer folder, when one is known
    tokenizer_sha256: str         # of the training tokenizer (checkpoints), "" when unknown


def is_checkpoint(path: Path) -> bool:
    return (path / "manifest.json").is_file() or (path / "latest").is_file()


def load_checkpoint_model(path: str | Path) -> EvalModel:
    """The training model of a project checkpoint (distsparse.eval.checkpoint_model)."""
    trained = load_trained_model(path)
    cfg = trained.cfg
    tokenizer_dir = Path(cfg.data.dir) / "tokenizer"
    return EvalModel(trained.model, "checkpoint", trained.checkpoint.path, cfg.data.seq_len,
                     tokenizer_dir if tokenizer_dir.is_dir() else None,
                     trained.checkpoint.manifest.get("tokenizer_sha256", ""))


def load_hf_model(path: str | Path) -> EvalModel:
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return EvalModel(model.eval(), "hf", path, None, path if has_tokenizer else None, "")


def load_model(path: str | Path) -> EvalModel:
    """A project checkpoint (step directory or root) or a Hugging Face folder; ValueError for anything else."""
    path = Path(path)
    if is_checkpoint(path):
        return load_checkpoint_model(path)
    if (path / "config.json").is_file():
        return load_hf_model(path)
    raise ValueError(f"CKPT_OR_HF_DIR: got {str(path)!r}; allowed: a checkpoint directory (manifest.json), a "
                     "checkpoint root (latest), or a Hugging Face folder (config.json)")


def check_data(loaded: EvalModel, meta: dict, data_dir: str | Path) -> None:
    """Refuse data the model cannot score: a larger vocabulary, or another tokenizer than the run's."""
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    if meta["vocab_size"] > vocab:
        raise ValueError(f"--data: got {str(data_dir)!r} with vocab_size {meta['vocab_size']}; allowed: data whose "
                         f"vocabulary fits the model's embedding ({vocab} rows)")
    want, have = loaded.tokenizer_sha256, meta.get("tokenizer_sha256", "")
    if want and have and want != have:
        raise ValueError(f"--data: got {str(data_dir)!r}, tokenized with another tokenizer (sha256 {have[:12]}...) "
                         f"than the run's (sha256 {want[:12]}... in the checkpoint manifest)")


def evaluate_perplexity(model: nn.Module, data_dir: str | Path, split: str, seq_len: int, batch_size: int,
                        max_samples: int | None = None, device: torch.device | str = "cpu") -> dict:
    """Token-weighted loss and PPL of `model` on the first `max_samples` samples (all when None) of a split."""
    if batch_size < 1:
        raise ValueError(f"--batch-size: got {batch_size}; allowed: >= 1")
    dataset = TokenDataset(data_dir, split, seq_len)
    index_batches = validation_batches(len(dataset), batch_size, world_size=1, rank=0, max_samples=max_samples)
    total, count = loss_sums(model, (collate(dataset, idx) for idx in index_batches), device)
    loss, ppl = perplexity(total, count)
    return {"loss": loss, "ppl": ppl, "tokens": count, "samples": sum(len(b) for b in index_batches),
            "split": split, "mode": dataset.mode, "seq_len": seq_len}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m distsparse.eval.perplexity",
                                description="Token-weighted validation loss and perplexity of a checkpoint or "
                                            "Hugging Face folder on a prepared data directory.")
    p.add_argument("model", metavar="CKPT_OR_HF_DIR")
    p.add_argument("--data", required=True, metavar="DIR", help="prepared data directory (data_prep.prepare)")
    p.add_argument("--split", default="val", choices=("val", "train"))
    p.add_argument("--seq-len", type=int, default=None,
                   help="default: the checkpoint's data.seq_len, else the data's prepared seq_len")
    p.add_argument("--max-samples", type=int, default=None, help="evaluate the first N samples (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    return p.parse_args(argv)


def perplexity_main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loaded = load_model(args.model)
        meta = load_meta(args.data)
        check_data(loaded, meta, args.data)
        seq_len = args.seq_len or loaded.seq_len or meta["seq_len"]
        model = loaded.model.to(args.device, DTYPES[args.dtype])
        result = evaluate_perplexity(model, args.data, args.split, seq_len, args.batch_size, args.max_samples,
                                     args.device)
    except ValueError as err:   # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = {"model": str(loaded.path), "source": loaded.source, "data": str(args.data), "dtype": args.dtype,
              **result}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key.ljust(width)}  {value:.4f}" if isinstance(value, float) else f"{key.ljust(width)}  {value}")
    return 0
