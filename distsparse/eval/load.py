"""Loading a model to evaluate: a project checkpoint or a Hugging Face folder, with what is known of its run.

`load_model(path)` accepts either
- a Hugging Face folder (config.json + weights, e.g. tools/export_hf.py's output): `AutoModelForCausalLM`. An
  export's config.json carries the run's sequence length and tokenizer checksum under `distsparse`;
- a project checkpoint: a step directory holding manifest.json, or a checkpoint root holding `latest`. The training
  model is rebuilt from the manifest's resolved config (distsparse.checkpoint.model.load_trained_model): the
  backbone gets the fp32 masters and codes of backbone/rank*.safetensors, the dense side the "<param>::master"
  entries of dense_state.safetensors, learned permutations their state from registry.safetensors. Only project
  files are read, no DeepSpeed pickle (DESIGN decision 6), and the model is the training model itself, so
  input-dependent branches (CoMoLoRA, Prod-Gate) evaluate as trained (DESIGN decision 13).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from distsparse.checkpoint.manifest import MANIFEST
from distsparse.checkpoint.model import load_trained_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXPORT_KEY = "distsparse"   # config.json key under which tools/export_hf.py records the run


@dataclass
class EvalModel:
    model: nn.Module              # eval mode, fp32, on CPU
    source: str                   # "hf" | "checkpoint"
    path: Path                    # the folder given, or the checkpoint step directory found under it
    seq_len: int | None           # the training sequence length (checkpoints and exports record it), else None
    tokenizer_dir: Path | None    # an AutoTokenizer folder, when one is known
    tokenizer_sha256: str         # of the training tokenizer (checkpoints and exports), "" when unknown


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / "latest").is_file()


def load_checkpoint_model(path: str | Path) -> EvalModel:
    """The training model of a project checkpoint."""
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
    run = getattr(model.config, EXPORT_KEY, None) or {}
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return EvalModel(model.eval(), "hf", path, run.get("seq_len"), path if has_tokenizer else None,
                     run.get("tokenizer_sha256", ""))


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
                         f"than the run's (sha256 {want[:12]}... recorded with the model)")
