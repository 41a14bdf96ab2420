"""The perplexity command: token-weighted validation loss and PPL of a checkpoint or Hugging Face folder.

    python -m distsparse.eval.perplexity CKPT_OR_HF_DIR --data DIR [--split val] [--seq-len N] [--max-samples N]
        [--batch-size N] [--device cpu|cuda] [--dtype fp32|bf16] [--json PATH]

The model loads through distsparse/eval/load.py. The sequence length defaults to the run's: the checkpoint's
`data.seq_len`, or the one an export recorded in its config.json; only a folder that records none falls back to
the data's prepared seq_len (and says so). The PPL is token-weighted over every scored target token of the split
(loss.py); in `truncate_pad` data the pad positions carry label -100 and are not scored (DESIGN s6 data modes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn as nn

from distsparse.data import TokenDataset, collate, load_meta, validation_batches
from distsparse.eval.load import DTYPES, check_data, load_model
from distsparse.eval.loss import loss_sums, perplexity

log = logging.getLogger("distsparse")


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
                   help="default: the run's (the checkpoint's data.seq_len, or an export's recorded one), else "
                        "the data's prepared seq_len")
    p.add_argument("--max-samples", type=int, default=None, help="evaluate the first N samples (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    p.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loaded = load_model(args.model)
        meta = load_meta(args.data)
        check_data(loaded, meta, args.data)
        seq_len = args.seq_len or loaded.seq_len
        if seq_len is None:
            seq_len = meta["seq_len"]
            log.warning("%s records no training sequence length: using the data's prepared seq_len %d (pass "
                        "--seq-len to match the run's)", loaded.path, seq_len)
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


if __name__ == "__main__":
    raise SystemExit(main())
