"""Consolidate a distsparse checkpoint into one fp32 state dict (safetensors), backbone included (issue 7 item 6).

DeepSpeed's `zero_to_fp32` rebuilds only what its ZeRO partitions hold, i.e. the dense side: the backbone
matrices are excluded from DeepSpeed's optimizer (DESIGN decision 1), so it drops them. This tool reads the
project's own files instead (safetensors only, no pickle; DESIGN decision 6):
    dense_state.safetensors         fp32 masters of every dense-side parameter, by name
    backbone/rank*.safetensors      fp32 masters and codes of every backbone matrix, from whichever rank owned it
rebuilds the training model from the manifest's config (`build_model`), loads those into it, and writes

    every parameter of the training model under its own name   fp32 master (compressed backbones: `values`)
    <core>.codes                                               uint8 packed N:M metadata (compressed backbones)
    <projection>.decompressed_weight                           fp32 [O, I] backbone weight the model computes
                                                               with: decompressed values, or the masked
                                                               latent (ste/srste/cast), or the dense weight;
                                                               no branch folded in

Not included: CAST's stored mask buffer (training state recomputed every `mask_update_interval` steps; it lives
only in DeepSpeed's module file) and non-persistent buffers (RoPE frequencies).

    python tools/consolidate.py CKPT OUT.safetensors

CKPT is a checkpoint directory (`.../checkpoints/step00000120`) or a checkpoint root holding `latest`. The file
hashes of the manifest are verified first; a corrupt or incomplete checkpoint is refused with the file named.
tools/export_hf.py builds on `load_trained_model` from this file.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from benchlib import print_table
from distsparse.config import Config, build_dataclass
from distsparse.layers import NMSparseLinear
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.models import backbone_modules, backbone_param, build_model
from distsparse.train.checkpoint import CheckpointError, CheckpointManager, LoadedCheckpoint

DENSE_STATE = "dense_state.safetensors"
EMBEDDING_MASTER = "model.embed_tokens.weight::master"


@dataclass
class TrainedModel:
    model: nn.Module               # the training model (build_model), fp32, eval mode, checkpoint state loaded
    cfg: Config                    # the run's resolved config, from the manifest
    checkpoint: LoadedCheckpoint   # path and manifest
    vocab_size: int


def find_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """A verified checkpoint: `path` itself when it holds manifest.json, else the newest complete one under it."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return CheckpointManager(path.parent).find(str(path))
    if not path.is_dir():
        raise ValueError(f"CKPT: got {str(path)!r}; allowed: a checkpoint directory (holding manifest.json) or a "
                         f"checkpoint root (holding `latest` and step* directories)")
    found = CheckpointManager(path).find("auto")
    if found is None:
        raise ValueError(f"CKPT: got {str(path)!r}; no complete checkpoint under it")
    return found


@torch.no_grad()
def load_trained_model(path: str | Path) -> TrainedModel:
    """The training model of a checkpoint, rebuilt from its config and loaded from the project's fp32 files."""
    ckpt = find_checkpoint(path)
    manager = CheckpointManager(ckpt.path.parent)
    cfg = build_dataclass(Config, ckpt.manifest["config"], "")
    dense = manager.load_tensors(ckpt, DENSE_STATE)
    # The manifest records no vocab (it may come from the data's meta.json): the embedding's rows are it.
    vocab_size = dense[EMBEDDING_MASTER].shape[0]
    model = build_model(cfg.model, cfg.method, vocab_size, cfg.train.seed)
    backbone = backbone_modules(model)
    states = manager.load_backbone(ckpt, list(backbone))
    for name, core in backbone.items():
        state = states[name]
        if isinstance(core, NMSparseLinear):
            core.set_codes(state["codes"])   # codes first: they decide where each value sits
        backbone_param(core).copy_(state["master"])
    backbone_ids = {id(backbone_param(core)) for core in backbone.values()}
    for name, param in model.named_parameters():
        if id(param) in backbone_ids:
            continue
        key = f"{name}::master"
        if key not in dense:
            raise CheckpointError(f"checkpoint file {ckpt.path / DENSE_STATE} has no {key!r}; the checkpoint does "
                                  f"not match the model its manifest describes")
        param.copy_(dense[key])
    return TrainedModel(model.eval(), cfg, ckpt, vocab_size)


def decompressed_weight(core: nn.Module) -> torch.Tensor:
    """fp32 [O, I]: the backbone weight a core computes with at evaluation."""
    if isinstance(core, NMSparseLinear):
        return core.dense_weight()
    if isinstance(core, DenseLatentLinear):
        return core.export_weight()
    return core.weight.detach()


def consolidated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, compressed codes and decompressed backbone weights (module docstring), fp32 and contiguous."""
    out = {name: p.detach().float().contiguous() for name, p in model.named_parameters()}
    for name, core in backbone_modules(model).items():
        if isinstance(core, NMSparseLinear):
            core_name = name if model.get_submodule(name) is core else f"{name}.core"   # SparseProjection
            out[f"{core_name}.codes"] = core.codes.contiguous()
        out[f"{name}.decompressed_weight"] = decompressed_weight(core).float().contiguous()
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or checkpoint root")
    p.add_argument("out", metavar="OUT.safetensors", help="output file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        trained = load_trained_model(args.checkpoint)
    except ValueError as err:   # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = consolidated_state(trained.model)
    manifest = trained.checkpoint.manifest
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"source": str(trained.checkpoint.path), "step": str(manifest["step"]),
                                          "config": json.dumps(manifest["config"])})
    print_table(["checkpoint", "step", "parameters", "backbone matrices", "tensors", "bytes", "output"],
                [[str(trained.checkpoint.path), manifest["step"], sum(1 for _ in trained.model.parameters()),
                  len(backbone_modules(trained.model)), len(state), out.stat().st_size, str(out)]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
