"""A tiny prepared data directory written by the tests: a learnable token stream in the data_prep layout
(train.bin / val.bin uint16 memmaps, meta.json)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def make_data_dir(path: Path, vocab_size: int = 97, train_tokens: int = 20000, val_tokens: int = 4000,
                  seed: int = 0) -> str:
    """Tokens follow a fixed random bigram table with a little noise, so a model can learn them."""
    rng = np.random.default_rng(seed)
    successor = rng.integers(4, vocab_size, size=vocab_size)

    def stream(n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint16)
        tok = 4
        for i in range(n):
            tok = successor[tok] if rng.random() > 0.1 else rng.integers(4, vocab_size)
            out[i] = tok
        return out

    path.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        tokens = stream(n)
        tokens.tofile(path / f"{split}.bin")
        counts[split] = n
    meta = {"vocab_size": vocab_size, "dtype": "uint16", "mode": "packed", "seq_len": 64, "source": "synthetic",
            "num_tokens": counts, "num_docs": {"train": 1, "val": 1}, "bos_id": 1, "eos_id": 2, "pad_id": 3,
            "unk_id": 0, "tokenizer_sha256": "", "unigram_val_ppl": float(vocab_size)}
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)
