"""Export a distsparse checkpoint as a Hugging Face folder (issue 7 item 6, issue 8 item 3, DESIGN decision 13).

    python tools/export_hf.py CKPT OUT [--data DIR] [--require-nm]

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
                                     A projection that keeps an input gather (below) also has
                                     `<projection>.input_perm` int64 [I]: its values and codes act on x[..., input_perm].
                                     Absent for dense models.

Input permutations (ShuffleSparse, y = W (x[..., perm])) must all be hard; a checkpoint with soft blocks (saved
before T_perm) is refused with the projection named. Then, as distsparse/layers/fold.py explains:
- folded where exact (row-wise layouts): down_proj's gather into gate_proj/up_proj output rows, o_proj's into
  v_proj's when the permutation blocks lie within heads. Those HF weights stay N:M sparse as they are.
- every other gather (q/k/v and gate/up, whose input is the residual stream; o_proj across heads; block-wise
  layouts) folds into the projection's own columns: W (x[..., perm]) = W[:, inv] x with inv the inverse of perm.
  A plain LlamaForCausalLM cannot hold a gather, but it holds W[:, inv] exactly; that weight is N:M sparse only in
  the permuted column order (W_hf[:, perm] is the trained N:M matrix), as tools/prune_oneshot.py writes its
  permuted projections. `--require-nm` refuses such a model instead, naming the projection and the reason.

Input-dependent branches (CoMoLoRA `como`, `prod_gate`) do not fold into a weight: they are refused with the branch
named (no trust_remote_code variant); evaluate such models in memory.

The model is rebuilt from the manifest's config and loaded from the project's fp32 files (distsparse.checkpoint.model,
`load_trained_model`, permutations included); no DeepSpeed file is unpickled. The weights come from
distsparse/eval/hf_weights.py (tools/consolidate.py writes the same ones). config.json records the run under
`distsparse` (seq_len, step, tokenizer_sha256): the perplexity command takes its default sequence length from there.
Files are written with the mode a plain `open()` gives (0644 under the usual umask 022). DIR defaults to the run's `data.dir`; its
tokenizer must be the one the run trained with (the manifest's `tokenizer_sha256`).
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
from transformers import LlamaConfig

from distsparse.report import print_table
from distsparse.checkpoint.files import save_safetensors
from distsparse.checkpoint.model import TrainedModel, load_trained_model
from distsparse.data import load_meta
from distsparse.eval.hf_weights import hf_state_dict, input_permutations, unfoldable
from distsparse.eval.load import EXPORT_KEY
from distsparse.layers import NMSparseLinear
from distsparse.layers.dense_latent import DenseLatentLinear
from distsparse.layers.fold import fold_permutations
from distsparse.models import backbone_modules, llama_config
from distsparse.nm import compress

log = logging.getLogger("distsparse")
COMPRESSED_FILE = "backbone_compressed.safetensors"


def check_exportable(trained: TrainedModel) -> None:
    """ValueError naming what cannot become a plain LlamaForCausalLM: an input-dependent branch, a soft permutation."""
    reason = unfoldable(trained)
    if reason is not None:
        raise ValueError(reason)


def fold_for_export(model: nn.Module, require_nm: bool = False) -> dict[str, dict]:
    """Fold every hard input permutation that folds exactly (fold_permutations, in place) and return its report;
    with `require_nm`, ValueError naming the first projection whose gather would have to go into its own columns
    (module docstring) before anything is changed."""
    if require_nm and (kept := fold_permutations(model, dry_run=True)["kept"]):
        name, why = min(kept.items())
        raise ValueError(
            f"{name}: its input permutation does not fold into another layer ({why}). A plain LlamaForCausalLM "
            f"cannot hold a gather; without --require-nm the export writes W[:, inv] for it, exact but N:M "
            f"sparse only in the permuted column order")
    return fold_permutations(model)


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
    for name, perm in input_permutations(trained.model).items():
        if name in shapes:
            tensors[f"{name}.input_perm"] = perm.perm_indices().contiguous()
    if not tensors:
        return {}, {}
    metadata = {"format": "distsparse-nm-v1", "sparsity": str(trained.cfg.method.sparsity),
                "layout": spec.layout, "shapes": json.dumps(shapes), "step": str(trained.checkpoint.manifest["step"])}
    return tensors, metadata


def copy_tokenizer(trained: TrainedModel, data_dir: Path, out: Path) -> dict:
    """Copy DIR/tokenizer/* into OUT after checking it is the run's tokenizer; returns the data's meta.json."""
    tok_dir = data_dir / "tokenizer"
    meta = load_meta(data_dir, key="--data")
    if not tok_dir.is_dir():
        raise ValueError(f"--data: got {str(data_dir)!r}; it has no tokenizer/ folder (a directory written by "
                         f"python -m data_prep.prepare has one)")
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


def save_hf_model(model: nn.Module, config: LlamaConfig, out: Path) -> None:
    """config.json and model.safetensors of a plain LlamaForCausalLM computing what `model` computes; fold or refuse
    its input permutations first (check_exportable, fold_for_export)."""
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    save_safetensors(hf_state_dict(model), out / "model.safetensors", metadata={"format": "pt"})


def export(checkpoint: str | Path, out: str | Path, data_dir: str | Path | None = None,
           require_nm: bool = False) -> Path:
    """Write the HF folder (module docstring); ValueError for what cannot be exported."""
    trained = load_trained_model(checkpoint)
    check_exportable(trained)
    report = fold_for_export(trained.model, require_nm)
    for reader, writers in sorted(report["folded"].items()):
        log.info("%s: input permutation folded into the output rows of %s", reader, ", ".join(writers))
    for name, why in sorted(report["kept"].items()):
        log.info("%s: input permutation kept in its own columns (%s)", name, why)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = copy_tokenizer(trained, Path(data_dir or trained.cfg.data.dir), out)
    config = llama_config(trained.cfg.model, trained.vocab_size)
    config.use_cache = True
    config.dtype = "float32"
    # -1: the tokenizer has no such token (an HF tokenizer without pad, say); transformers wants None there
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        meta[key] if meta[key] >= 0 else None for key in ("bos_id", "eos_id", "pad_id"))
    # The run's sequence length and tokenizer travel with the weights: the perplexity command and lm-eval read them.
    setattr(config, EXPORT_KEY, {"seq_len": trained.cfg.data.seq_len, "step": trained.checkpoint.manifest["step"],
                                 "tokenizer_sha256": trained.checkpoint.manifest.get("tokenizer_sha256", "")})
    save_hf_model(trained.model, config, out)
    tensors, metadata = compressed_backbone(trained)
    if tensors:
        save_safetensors(tensors, out / COMPRESSED_FILE, metadata=metadata)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or checkpoint root (holding `latest`)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--data", metavar="DIR",
                   help="prepared data directory holding tokenizer/ (default: the run's data.dir)")
    p.add_argument("--require-nm", action="store_true",
                   help="refuse a model whose input permutations do not all fold into other layers' rows, instead "
                        "of writing those projections as W[:, inv] (N:M only in the permuted column order)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        out = export(args.checkpoint, args.out, args.data, args.require_nm)
    except ValueError as err:   # CheckpointError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [[f.name, f.stat().st_size] for f in sorted(out.iterdir()) if f.is_file()]
    print_table(["file", "bytes"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
