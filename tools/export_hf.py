"""Export a distsparse checkpoint as a Hugging Face folder (issue 7 item 6, DESIGN decision 13).

    python tools/export_hf.py CKPT OUT [--data DIR]

OUT holds what `AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load:
    config.json, model.safetensors   a plain `LlamaForCausalLM` in fp32: every projection's weight is the backbone
                                     weight the model computes with (decompressed N:M values, or the masked
                                     latent of ste/srste/cast) plus, for foldable branches (LoRA kinds `add` and
                                     `add_align`), the branch folded in: W + (alpha/r) B A. With a folded branch the
                                     weight is no longer N:M sparse.
    tokenizer files                  copied from DIR/tokenizer (data_prep's HF tokenizer folder)
    backbone_compressed.safetensors  the compressed backbone, branches not folded: `<projection>.values` [O, K]
                                     fp32 (values[r, j] is the j-th kept weight of row r in ascending column order)
                                     and `<projection>.codes` uint8 (row-wise: packed 2-bit positions; block-wise:
                                     one motif id per 4x4 block); the metadata names sparsity, layout and shapes.
                                     Absent for dense models.

Input-dependent branches (CoMoLoRA `como`, `prod_gate`) do not fold into a weight: they are refused with the branch
named (no trust_remote_code variant); evaluate such models in memory. Input permutations are refused too: folding
them into neighbouring layers at export is not implemented yet (distsparse/layers/fold.py is the place).

The model is rebuilt from the manifest's config and loaded from the project's fp32 files (distsparse.eval.checkpoint_model,
`load_trained_model`); no DeepSpeed file is unpickled. DIR defaults to the run's `data.dir`; its tokenizer must be
the one the run trained with (the manifest's `tokenizer_sha256`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from benchlib import print_table
from consolidate import decompressed_weight
from distsparse.eval.checkpoint_model import TrainedModel, load_trained_model
from distsparse.layers import NMSparseLinear
from distsparse.layers.branches import FOLDABLE_KINDS, foldable
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.layers.projection import SparseProjection
from distsparse.models import backbone_modules, llama_config, projection_names
from distsparse.nm import compress

log = logging.getLogger("distsparse")
COMPRESSED_FILE = "backbone_compressed.safetensors"


def check_exportable(trained: TrainedModel) -> None:
    """ValueError naming what cannot become a plain LlamaForCausalLM."""
    kind = trained.cfg.method.branch.kind
    if not foldable(kind):
        raise ValueError(
            f"method.branch.kind: got {kind!r}; a {kind} branch is input-dependent (its output is modulated by a "
            f"function of x), so it does not fold into a LlamaForCausalLM weight. Allowed for export: "
            f"{', '.join(FOLDABLE_KINDS)}. Evaluate this model in memory (distsparse.eval) instead")
    for name in projection_names(trained.model):
        outer = trained.model.get_submodule(name)
        if isinstance(outer, SparseProjection) and outer.permutation is not None:
            raise ValueError(f"{name}: the model has input permutations; export does not fold them into a plain "
                             f"LlamaForCausalLM yet (method.permutation.mode: got "
                             f"{trained.cfg.method.permutation.mode!r}; allowed for export: none)")


@torch.no_grad()
def projection_weight(outer: nn.Module) -> torch.Tensor:
    """[O, I] fp32: x W^T equals the projection's output (backbone plus folded LoRA branch)."""
    if not isinstance(outer, SparseProjection):
        return decompressed_weight(outer).float()
    weight = decompressed_weight(outer.core).float()
    if outer.branch is not None:
        weight = weight + outer.branch.delta_weight().float()
    return weight


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM names: the training model's own parameters outside the projections (HF names already)
    and one `<projection>.weight` per projection."""
    names = projection_names(model)
    inside = {id(p) for name in names for p in model.get_submodule(name).parameters()}
    state = {n: p.detach().float().contiguous() for n, p in model.named_parameters() if id(p) not in inside}
    for name in names:
        state[f"{name}.weight"] = projection_weight(model.get_submodule(name)).contiguous()
    return state


@torch.no_grad()
def compressed_backbone(trained: TrainedModel) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the side file; empty for dense backbones."""
    spec = trained.cfg.method.spec
    tensors, shapes = {}, {}
    for name, core in backbone_modules(trained.model).items():
        if isinstance(core, NMSparseLinear):
            values, codes = core.values.detach().float(), core.codes
        elif isinstance(core, DenseLatentLinear) and core.spec is not None:
            values, meta = compress(core.export_weight().float(), core.export_mask(), core.spec)
            codes = meta.codes
        else:
            continue
        tensors[f"{name}.values"] = values.contiguous()
        tensors[f"{name}.codes"] = codes.contiguous()
        shapes[name] = [core.out_features, core.in_features]
    if not tensors:
        return {}, {}
    metadata = {"format": "distsparse-nm-v1", "sparsity": str(trained.cfg.method.sparsity),
                "layout": spec.layout, "shapes": json.dumps(shapes), "step": str(trained.checkpoint.manifest["step"])}
    return tensors, metadata


def copy_tokenizer(trained: TrainedModel, data_dir: Path, out: Path) -> dict:
    """Copy DIR/tokenizer/* into OUT after checking it is the run's tokenizer; returns the data's meta.json."""
    tok_dir, meta_path = data_dir / "tokenizer", data_dir / "meta.json"
    if not tok_dir.is_dir() or not meta_path.exists():
        raise ValueError(f"--data: got {str(data_dir)!r}; it needs tokenizer/ and meta.json (a directory written by "
                         f"python -m data_prep.prepare)")
    meta = json.loads(meta_path.read_text())
    want, have = trained.checkpoint.manifest.get("tokenizer_sha256", ""), meta.get("tokenizer_sha256", "")
    if want and want != have:
        raise ValueError(f"--data: got {str(data_dir)!r}, whose tokenizer (sha256 {have[:12]}...) is not the one "
                         f"the run trained with (sha256 {want[:12]}... in the checkpoint manifest)")
    if not want:
        log.warning("the checkpoint records no tokenizer checksum: %s is copied unchecked", tok_dir)
    for f in sorted(tok_dir.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return meta


def export(checkpoint: str | Path, out: str | Path, data_dir: str | Path | None = None) -> Path:
    """Write the HF folder (module docstring); ValueError for what cannot be exported."""
    trained = load_trained_model(checkpoint)
    check_exportable(trained)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = copy_tokenizer(trained, Path(data_dir or trained.cfg.data.dir), out)
    config = llama_config(trained.cfg.model, trained.vocab_size)
    config.use_cache = True
    config.dtype = "float32"
    config.bos_token_id, config.eos_token_id, config.pad_token_id = meta["bos_id"], meta["eos_id"], meta["pad_id"]
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    save_file(hf_state_dict(trained.model), str(out / "model.safetensors"), metadata={"format": "pt"})
    tensors, metadata = compressed_backbone(trained)
    if tensors:
        save_file(tensors, str(out / COMPRESSED_FILE), metadata=metadata)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or checkpoint root (holding `latest`)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--data", metavar="DIR",
                   help="prepared data directory holding tokenizer/ (default: the run's data.dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        out = export(args.checkpoint, args.out, args.data)
    except ValueError as err:   # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [[f.name, f.stat().st_size] for f in sorted(out.iterdir()) if f.is_file()]
    print_table(["file", "bytes"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
