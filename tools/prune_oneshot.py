"""One-shot N:M pruning of a pretrained Hugging Face LLaMA checkpoint (issue 8 item 4): magnitude, Wanda or
SparseGPT, sequential layer by layer as their reference code does, with an optional input permutation per
group of projections (fixed random, or learned by ShuffleSparse Algorithm 1). Prints the validation
perplexity before and after (token-weighted), saves a model `AutoModelForCausalLM.from_pretrained` loads, and
prints a table last.

    python tools/prune_oneshot.py --model HF_DIR --method wanda --nm 2:4 --calib DATA_DIR --out OUT_DIR
    python tools/prune_oneshot.py --model HF_DIR --method wanda --permutation learned --calib DATA_DIR \\
        --nsamples 128 --seqlen 1024 --out OUT_DIR --json prune.json

DATA_DIR is made by `python -m data_prep.prepare` (packed mode): calibration windows are drawn at random from
train.bin, validation windows are the first non-overlapping windows of val.bin.
Library: distsparse/pruning/ (calibration.py is the driver); research/permutations_pruning.md s3, s5, s8.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from distsparse.report import add_json_arg, machine_info, print_table, write_json
from distsparse.eval.perplexity import loss_sums, perplexity
from distsparse.data.shards import TokenStream, split_files
from distsparse.nm import NMSpec
from distsparse.pruning import METHODS, PERMUTATIONS, PermutationConfig, PruneConfig, check_model, prune_model

log = logging.getLogger("prune_oneshot")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of the source checkpoint that save_pretrained does not write but users of the output need.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")

EPILOG = """\
permutations (--permutation random|learned):
  One permutation per group of projections that read the same input: q/k/v share one, gate/up share one,
  o_proj and down_proj have their own; block-diagonal with --perm-block x --perm-block blocks.
  The saved model is EXACT and dense-format: each weight is stored in its ORIGINAL column order
  (W = W_s[:, inverse(perm)]), so it runs as a plain LlamaForCausalLM with no gather. Its N:M groups are
  contiguous only in permuted coordinates: W[:, perm] is row-wise N:4 and a 2:4 kernel computes
  F.linear(x[..., perm], W[:, perm]). The index vectors are written next to the model in
  OUT_DIR/permutations.safetensors, one int64 tensor per projection keyed by module name
  (e.g. model.layers.0.self_attn.q_proj). Without permutations the saved weights are N:4 as stored.

learned permutation (ShuffleSparse Algorithm 1, frozen weights):
  soft doubly stochastic blocks (Sinkhorn of |theta|), Hungarian decoding with a straight-through estimator,
  the method's score |W| diag(s) in permuted coordinates (s = Wanda column norms; ones for magnitude; for
  SparseGPT the Wanda score is the learning proxy and SparseGPT then prunes in the learned coordinates), a
  hard top-N mask with a softmax surrogate, l1-l2 penalty ramped to --perm-lambda, --perm-steps Adam steps.
  Objective (--perm-objective): 'layer' (DEFAULT) = per-layer cosine reconstruction of each decoder layer's
  dense output on its calibration inputs, learned inside the sequential loop; 'stack' = cosine
  reconstruction of the dense model's last hidden state, all layers learned jointly on the dense model's
  activation scales (PermLLM's objective), then the sequential driver prunes in the learned coordinates.
  'stack' backpropagates through every layer and holds every layer's soft masks at once (about 30 bytes per
  weight: fine for small models, not for 7B on one GPU); 'layer' holds one layer's.
  A layer keeps the identity when the learned permutation does not beat it on the full calibration set.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the epilog's line breaks and shows the default of every optional flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.required else super()._get_help_string(action)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG, formatter_class=_HelpFormatter)
    p.add_argument("--model", required=True, metavar="HF_DIR", help="pretrained checkpoint (save_pretrained dir)")
    p.add_argument("--method", required=True, choices=METHODS, help="pruning criterion")
    p.add_argument("--nm", default="2:4", help="weights KEPT per group of 4 input columns: 1:4, 2:4 or 3:4")
    p.add_argument("--permutation", default="none", choices=PERMUTATIONS, help="input permutation per group")
    p.add_argument("--calib", required=True, metavar="DATA_DIR", help="data dir with meta.json, train.bin, val.bin")
    p.add_argument("--nsamples", type=int, default=128, help="calibration sequences from train.bin")
    p.add_argument("--seqlen", type=int, default=1024, help="tokens per calibration and validation sequence")
    p.add_argument("--val-samples", type=int, default=64,
                   help="validation sequences of --seqlen tokens from val.bin (0 skips the PPL)")
    p.add_argument("--out", required=True, metavar="OUT_DIR", help="where the pruned model is saved")
    p.add_argument("--blocksize", type=int, default=128, help="SparseGPT column block")
    p.add_argument("--percdamp", type=float, default=0.01, help="SparseGPT damping, fraction of mean(diag H)")
    defaults = PermutationConfig()
    p.add_argument("--perm-block", type=int, default=defaults.block_size, help="permutation block size")
    p.add_argument("--perm-steps", type=int, default=defaults.steps,
                   help="Adam steps per layer ('layer') or for the model ('stack')")
    p.add_argument("--perm-lr", type=float, default=defaults.lr, help="Adam learning rate of the permutations")
    p.add_argument("--perm-lambda", type=float, default=defaults.lambda_max, help="final l1-l2 penalty weight")
    p.add_argument("--perm-temp", type=float, default=defaults.temperature,
                   help="temperature of the soft top-N surrogate (relative to the row-mean score)")
    p.add_argument("--perm-batch", type=int, default=defaults.batch_size, help="sequences per Adam step")
    p.add_argument("--perm-objective", default=defaults.objective, choices=("layer", "stack"),
                   help="layer: per-layer cosine reconstruction; stack: whole-stack cosine (see below)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    p.add_argument("--seed", type=int, default=0, help="calibration windows, random permutations, mini-batches")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="compute dtype; auto = the checkpoint's on CUDA, float32 on CPU")
    add_json_arg(p)
    return p.parse_args(argv)


def parse_nm(text: str) -> int:
    """'2:4' -> 2; anything else raises ValueError naming --nm."""
    try:
        return NMSpec.parse(text).n
    except ValueError as err:
        raise ValueError(f"--nm: got {text!r}; allowed: 1:4, 2:4, 3:4 (N kept of M = 4)") from err


def load_split(data_dir: Path, split: str, vocab_size: int) -> TokenStream:
    """The tokens of `split` ('train' or 'val') as one stream, checked against meta.json and the model's vocab."""
    meta_path = data_dir / "meta.json"
    if not meta_path.exists():
        raise ValueError(f"--calib: got {str(data_dir)!r}; no meta.json there. Prepare data first: "
                         f"python -m data_prep.prepare --out {data_dir}")
    meta = json.loads(meta_path.read_text())
    if meta.get("mode", "packed") != "packed":
        raise ValueError(f"--calib: data in {data_dir} has mode {meta.get('mode')!r}; allowed: packed "
                         f"(calibration and validation windows are cut from one token stream)")
    if meta["vocab_size"] > vocab_size:
        raise ValueError(f"--calib: data vocab_size {meta['vocab_size']} exceeds the model's {vocab_size}; "
                         f"allowed: data made with the model's tokenizer")
    files = split_files(data_dir, meta, split)   # meta.json's shards, or the single SPLIT.bin of older data
    missing = [path.name for path, _ in files if not path.exists()]
    if missing:
        raise ValueError(f"--calib: got {str(data_dir)!r}; {', '.join(missing)} is missing")
    return TokenStream(files, np.dtype(meta["dtype"]))


def calibration_windows(tokens: np.ndarray, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """int64 [nsamples, seqlen] windows at uniform random offsets (Wanda's and SparseGPT's C4 sampling)."""
    if nsamples <= 0:
        raise ValueError(f"--nsamples: got {nsamples}; allowed: a positive integer")
    if len(tokens) <= seqlen:
        raise ValueError(f"--seqlen: got {seqlen}; the train split holds only {len(tokens)} tokens; "
                         f"allowed: < {len(tokens)}")
    starts = np.random.default_rng(seed).integers(0, len(tokens) - seqlen, size=nsamples)
    return torch.from_numpy(np.stack([tokens[s:s + seqlen] for s in starts]).astype(np.int64))


def validation_windows(tokens: np.ndarray, seqlen: int, max_windows: int) -> torch.Tensor:
    """int64 [w, seqlen]: the first min(max_windows, len // seqlen) non-overlapping windows."""
    count = min(max_windows, len(tokens) // seqlen)
    return torch.from_numpy(np.asarray(tokens[:count * seqlen]).astype(np.int64)).view(count, seqlen)


def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> tuple[float, float] | None:
    """(mean loss, PPL) over all next-token predictions of `windows`, or None when there are none."""
    if windows.shape[0] == 0:
        return None
    device = next(model.parameters()).device
    batches = ({"input_ids": w, "labels": w} for w in windows.split(batch_size))
    return perplexity(*loss_sums(model, batches, device))


def save_output(model: torch.nn.Module, out: Path, model_dir: Path, perms: dict[str, torch.Tensor],
                report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out / name)
    if perms:
        save_file({name: perm.contiguous() for name, perm in perms.items()}, str(out / "permutations.safetensors"),
                  metadata={"convention": "W[:, perm] is row-wise N:4; layer = F.linear(x[..., perm], W[:, perm])"})
    (out / "pruning.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    perm_cfg = PermutationConfig(block_size=args.perm_block, steps=args.perm_steps, lr=args.perm_lr,
                                 lambda_max=args.perm_lambda, temperature=args.perm_temp,
                                 batch_size=args.perm_batch, objective=args.perm_objective)
    cfg = PruneConfig(method=args.method, n=parse_nm(args.nm), permutation=args.permutation,
                      blocksize=args.blocksize, percdamp=args.percdamp, batch_size=args.batch_size,
                      seed=args.seed, perm=perm_cfg)
    if args.val_samples < 0:
        raise ValueError(f"--val-samples: got {args.val_samples}; allowed: >= 0")
    model_dir, data_dir = Path(args.model), Path(args.calib)
    dtype = DTYPES.get(args.dtype, "auto" if args.device.startswith("cuda") else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device)
    if args.seqlen > model.config.max_position_embeddings:
        raise ValueError(f"--seqlen: got {args.seqlen}; allowed: <= max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    check_model(model, cfg)
    vocab = model.config.vocab_size
    calib = calibration_windows(load_split(data_dir, "train", vocab), args.nsamples, args.seqlen, args.seed)
    val = validation_windows(load_split(data_dir, "val", vocab), args.seqlen, args.val_samples)

    before = evaluate(model, val, args.batch_size)
    if before:
        log.info("validation before: loss %.4f, PPL %.3f (%d sequences)", *before, val.shape[0])
    start = time.perf_counter()
    result = prune_model(model, calib, cfg)
    seconds = time.perf_counter() - start
    after = evaluate(model, val, args.batch_size)
    if after:
        log.info("validation after: loss %.4f, PPL %.3f", *after)

    report = {
        "val_loss_before": before and before[0], "ppl_before": before and before[1],
        "val_loss_after": after and after[0], "ppl_after": after and after[1],
        "prune_seconds": seconds, "layers": result.layers, "stack_permutation": result.stack,
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "perm"}, "nm": args.nm,
                   "perm": asdict(cfg.perm), "model": str(model_dir), "calib": str(data_dir),
                   "nsamples": args.nsamples, "seqlen": args.seqlen, "val_samples": int(val.shape[0]),
                   "device": args.device, "dtype": str(next(model.parameters()).dtype)},
        "machine": machine_info(),
    }
    save_output(model, Path(args.out), model_dir, result.perms, report)
    if args.json:
        write_json(args.json, report)

    perm_rows = [row for row in result.layers if "loss_learned" in row]
    if perm_rows:
        print_table(["layer", "perm loss identity", "perm loss learned", "gain", "kept", "moved"],
                    [[r["layer"], r["loss_identity"], r["loss_learned"], 1.0 - r["loss_learned"] / r["loss_identity"],
                      "learned" if r["used_learned"] else "identity", r["moved_fraction"]] for r in perm_rows])
        print()
    print_table(["method", "nm", "permutation", "ppl_before", "ppl_after", "prune_seconds"],
                [[args.method, args.nm, args.permutation, *("n/a" if v is None else v for v in
                                                            (report["ppl_before"], report["ppl_after"])),
                  seconds]])
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        main()
    except ValueError as err:
        sys.exit(f"error: {err}")
