"""The synthetic token stream benchmarks train on: uniform random tokens in the data_prep layout (uint16 train.bin /
val.bin, meta.json). Speed and memory do not depend on the text, so any tokens will do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_synthetic_data(path: Path, vocab_size: int, train_tokens: int, val_tokens: int = 4096,
                         seed: int = 0) -> str:
    """A prepared data directory of uniform tokens in [4, vocab_size); returns its path."""
    if not 4 < vocab_size <= 2**16:
        raise ValueError(f"vocab_size: got {vocab_size}; allowed: 5 .. 65536 (uint16 tokens above the specials)")
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        rng.integers(4, vocab_size, size=n, dtype=np.uint16).tofile(path / f"{split}.bin")
    meta = {"vocab_size": vocab_size, "dtype": "uint16", "mode": "packed", "seq_len": 256, "source": "synthetic",
            "num_tokens": {"train": train_tokens, "val": val_tokens}, "num_docs": {"train": 1, "val": 1},
            "bos_id": 1, "eos_id": 2, "pad_id": 3, "unk_id": 0, "tokenizer_sha256": "",
            "unigram_val_ppl": float(vocab_size)}
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)
