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
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from benchlib import print_table
from distsparse.eval.checkpoint_model import load_trained_model
from distsparse.layers import NMSparseLinear
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.models import backbone_modules


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
