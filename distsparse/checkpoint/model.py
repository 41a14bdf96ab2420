"""The training model of a project checkpoint, rebuilt from its manifest config and loaded from the project's
own fp32 files (backbone masters and codes, dense-side masters, registered permutation state): no DeepSpeed
pickle is read, and only the files read are hashed. Evaluation, export and consolidation all start here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from distsparse.config import Config
from distsparse.layers import NMSparseLinear
from distsparse.layers.permutation import BlockPermutation
from distsparse.models import backbone_modules, backbone_param, build_model
from distsparse.checkpoint.files import unflatten_states
from distsparse.checkpoint.manager import CheckpointManager
from distsparse.checkpoint.manifest import MANIFEST, CheckpointError, deepspeed_file
from distsparse.strict_config import build_dataclass
from distsparse.checkpoint.parts import DENSE_STATE, REGISTRY, LoadedCheckpoint, load_backbone, load_tensors

EMBEDDING_MASTER = "model.embed_tokens.weight::master"


@dataclass
class TrainedModel:
    model: nn.Module               # the training model (build_model), fp32, eval mode, checkpoint state loaded
    cfg: Config                    # the run's resolved config, from the manifest
    checkpoint: LoadedCheckpoint   # path and manifest
    vocab_size: int


def project_file(rel: str) -> bool:
    return not deepspeed_file(rel)


def find_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """A verified checkpoint: `path` itself when it holds manifest.json, else the newest intact one under it."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return CheckpointManager(path.parent).find(str(path), wanted=project_file)
    if not path.is_dir():
        raise ValueError(f"CKPT: got {str(path)!r}; allowed: a checkpoint directory (holding manifest.json) or a "
                         f"checkpoint root (holding `latest` and step* directories)")
    found = CheckpointManager(path).find("auto", wanted=project_file)
    if found is None:
        raise ValueError(f"CKPT: got {str(path)!r}; no complete checkpoint under it")
    return found


@torch.no_grad()
def load_trained_model(path: str | Path) -> TrainedModel:
    ckpt = find_checkpoint(path)
    cfg = build_dataclass(Config, ckpt.manifest["config"], "")
    dense = load_tensors(ckpt, DENSE_STATE)
    if EMBEDDING_MASTER not in dense:
        raise CheckpointError(f"checkpoint file {ckpt.path / DENSE_STATE} has no {EMBEDDING_MASTER!r}")
    vocab_size = ckpt.manifest.get("vocab_size") or dense[EMBEDDING_MASTER].shape[0]
    model = build_model(cfg.model, cfg.method, vocab_size, cfg.train.seed)
    backbone = backbone_modules(model)
    states = load_backbone(ckpt, sorted(backbone))
    for name, core in backbone.items():
        if isinstance(core, NMSparseLinear):
            core.set_codes(states[name]["codes"])   # codes first: they decide where each value sits
        backbone_param(core).copy_(states[name]["master"].view_as(backbone_param(core)))
    backbone_ids = {id(backbone_param(core)) for core in backbone.values()}
    for name, param in model.named_parameters():
        if id(param) in backbone_ids:
            continue
        key = f"{name}::master"
        if key not in dense:
            raise CheckpointError(f"checkpoint file {ckpt.path / DENSE_STATE} has no {key!r}; the checkpoint does "
                                  f"not match the model its manifest describes")
        param.copy_(dense[key].view_as(param))
    _load_permutations(model, ckpt)
    return TrainedModel(model.eval(), cfg, ckpt, vocab_size)


def _load_permutations(model: nn.Module, ckpt: LoadedCheckpoint) -> None:
    """Hardening state of learned permutations, from the registry the trainer writes (random and identity
    permutations are rebuilt from the seed)."""
    learned = {n: m for n, m in model.named_modules() if isinstance(m, BlockPermutation) and m.mode == "learned"}
    if not learned:
        return
    if not (ckpt.path / REGISTRY).exists():
        raise CheckpointError(f"checkpoint {ckpt.path}: {REGISTRY} is missing; learned permutations need it")
    saved = unflatten_states(load_tensors(ckpt, REGISTRY))
    for name, module in learned.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint file {ckpt.path / REGISTRY} has no state for permutation {name!r}")
        module.load_state_dict(saved[name])
