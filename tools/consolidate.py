"""Consolidate a distsparse checkpoint into one fp32 state dict that `LlamaForCausalLM.load_state_dict` accepts as
is (issue 7 item 6, issue 18 item 6).

DeepSpeed's `zero_to_fp32` rebuilds only what its ZeRO partitions hold, i.e. the dense side: the backbone
matrices are excluded from DeepSpeed's optimizer (DESIGN decision 1), so it drops them. This tool reads the
project's own files instead (safetensors only, no pickle; DESIGN decision 6), rebuilds the training model from the
manifest's config (distsparse.checkpoint.model) and writes

    OUT.safetensors   the keys of a LlamaForCausalLM, fp32: embeddings, norms and head under their own names, and
                      `<projection>.weight` for every projection: the backbone weight the model computes with
                      (decompressed N:M values, the masked latent of ste/srste/cast, or the dense weight), with a
                      hard input gather in its columns and a LoRA branch folded in (distsparse/eval/hf_weights.py,
                      the weights tools/export_hf.py writes). Loaded into LlamaForCausalLM it computes what the
                      training model computes. A model with an input-dependent branch or soft permutation blocks
                      has no such weights: OUT then holds the backbone cores alone, and the tool says why.
    --training-state PATH   optionally, the training model's own state dict under its own names: compressed
                      `values` and `codes`, branch and permutation parameters and hardening state.

Not included: CAST's stored mask buffer (training state recomputed every `mask_update_interval` steps; it lives
only in DeepSpeed's module file) and non-persistent buffers (RoPE frequencies).

    python tools/consolidate.py CKPT OUT.safetensors [--training-state PATH]

CKPT is a checkpoint directory (`.../checkpoints/step00000120`) or a checkpoint root holding `latest`. The size and
sha256 of every file read are checked against the manifest first; a damaged checkpoint is refused with the file
named. Files are written with the mode a plain `open()` gives (0644 under the usual umask 022).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from distsparse.report import print_table
from distsparse.checkpoint.files import save_safetensors
from distsparse.checkpoint.model import load_trained_model
from distsparse.eval.hf_weights import hf_state_dict, unfoldable
from distsparse.models import backbone_modules

log = logging.getLogger("distsparse")


def training_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of the training model under its own name; a module shared by several
    projections (an input permutation) appears once, under its first name, as named_parameters gives it."""
    persistent = model.state_dict().keys()
    tensors = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n in persistent}
    return {name: t.detach().contiguous() for name, t in tensors.items()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or checkpoint root")
    p.add_argument("out", metavar="OUT.safetensors", help="output file (LlamaForCausalLM keys)")
    p.add_argument("--training-state", metavar="PATH", help="also write the training model's own state dict")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        trained = load_trained_model(args.checkpoint)
    except ValueError as err:   # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    reason = unfoldable(trained)
    if reason is not None:
        log.warning("%s holds the backbone cores only, not the whole model: %s", args.out, reason)
    manifest = trained.checkpoint.manifest
    metadata = {"source": str(trained.checkpoint.path), "step": str(manifest["step"]),
                "config": json.dumps(manifest["config"]), "folded": str(reason is None)}
    outputs = [(Path(args.out), hf_state_dict(trained.model, fold=reason is None))]
    if args.training_state:
        outputs.append((Path(args.training_state), training_state(trained.model)))
    rows = []
    for path, state in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors(state, path, metadata=metadata)
        rows.append([str(path), manifest["step"], len(backbone_modules(trained.model)), len(state),
                     path.stat().st_size])
    print_table(["output", "step", "backbone matrices", "tensors", "bytes"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
