"""Token-shard dataset: samples of a prepared data directory (data_prep/prepare.py) as LongTensors.

Owns reading `meta.json` and cutting samples from a split's shards (shards.py: meta.json's `shards` list, or the
single `train.bin` / `val.bin` of preparations made before shards); does not decide order (sampler.py).
DESIGN s6 data modes:
- `packed`: one EOS-separated token stream; sample i is tokens[i*seq_len:(i+1)*seq_len] (the tail shorter than
  seq_len is not used). Any seq_len works; meta's unigram PPL was computed with the prepared one.
- `truncate_pad`: one row per document, padded at the end; seq_len must equal the prepared one.
Labels equal input_ids except -100 at pad; HF LlamaForCausalLM shifts labels by one internally.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from distsparse.data.shards import TokenStream, split_files

SPLITS = ("train", "val")
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index, used by HF models
META_KEYS = ("vocab_size", "dtype", "mode", "seq_len", "num_tokens", "eos_id", "pad_id")


def load_meta(data_dir: str | Path, key: str = "data_dir") -> dict:
    """meta.json of a prepared directory, the one place it is read; ValueError naming `key` (the setting that gave
    the directory), the directory, and the missing or damaged file or key."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise ValueError(f"{key}: got {str(data_dir)!r}, which is not a directory; allowed: a directory written by "
                         f"`python -m data_prep.prepare --out DIR`, e.g. python -m data_prep.prepare --source "
                         f"stdlib-docs --out {data_dir}")
    meta_file = data_dir / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"{key}: {str(data_dir)!r} has no meta.json (missing file: {meta_file}); allowed: a "
                         "finished `python -m data_prep.prepare --out DIR` (meta.json is written last)")
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}: {meta_file} is not valid UTF-8 JSON ({err}); re-run data_prep.prepare") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{key}: {meta_file} holds a JSON {type(meta).__name__}, not an object; re-run "
                         "data_prep.prepare")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{key}: {meta_file} misses keys {missing}; re-run data_prep.prepare")
    return meta


class TokenDataset(Dataset):
    """`ds[i] -> {"input_ids": int64 [seq_len], "labels": int64 [seq_len]}` from one split's shards, read as one
    token stream in meta.json's shard order (shards.py), so a sample may span two shards."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"split: got {split!r}; allowed: {', '.join(SPLITS)}")
        self.meta = load_meta(data_dir)
        self.mode = self.meta["mode"]
        self.pad_id = self.meta["pad_id"]
        self.seq_len = seq_len
        files = split_files(Path(data_dir), self.meta, split)
        for path, _ in files:
            if not path.is_file():
                raise ValueError(f"data_dir: {str(data_dir)!r} has no {path.name} (missing file: {path})")
        self._check_sizes(split, files)
        if self.mode == "truncate_pad" and seq_len != self.meta["seq_len"]:
            raise ValueError(f"seq_len: got {seq_len}; allowed: {self.meta['seq_len']} (the data in {data_dir} is "
                             "truncate_pad rows of that length; re-prepare it for another length)")
        if self.mode == "packed" and seq_len < 2:
            raise ValueError(f"seq_len: got {seq_len}; allowed: >= 2")
        self.tokens = TokenStream(files, np.dtype(self.meta["dtype"]))
        # truncate_pad: whole rows; packed: the tail shorter than seq_len is in no sample.
        self.num_samples = len(self.tokens) // seq_len
        if self.num_samples == 0:
            raise ValueError(f"seq_len: got {seq_len}; allowed: <= {len(self.tokens)}, the {split} split's length")

    def _check_sizes(self, split: str, files: list[tuple[Path, int]]) -> None:
        """Each shard's size against meta.json: whole tokens (whole rows in truncate_pad) and, where meta.json counts
        them (packed data, every shard of a sharded preparation), its tokens, so a truncated shard is refused
        naming the file rather than read as a shorter split."""
        dtype = np.dtype(self.meta["dtype"])
        row = self.meta["seq_len"] if self.mode == "truncate_pad" else 1
        counts = self.meta["num_tokens"]
        single = self.meta.get("shards") is None
        for path, stored in files:
            size = path.stat().st_size
            if single:   # one SPLIT.bin: meta.json counts its tokens in packed mode only
                expected = counts.get(split) if self.mode == "packed" and isinstance(counts, dict) else None
            else:
                expected = stored
            unit = dtype.itemsize * row
            if size % unit or (isinstance(expected, int) and size != expected * dtype.itemsize):
                said = (f"{expected} {dtype} tokens ({expected * dtype.itemsize} bytes)" if isinstance(expected, int)
                        else f"whole {f'rows of {row} ' if row > 1 else ''}{dtype} tokens")
                raise ValueError(f"data_dir: {path} holds {size} bytes; its meta.json says {said}: the shard is "
                                 f"truncated or damaged; allowed: the files of one finished data_prep.prepare run")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range [0, {self.num_samples})")
        start = index * self.seq_len
        input_ids = torch.from_numpy(self.tokens.read(start, start + self.seq_len).astype(np.int64))
        labels = input_ids.clone()
        if self.mode == "truncate_pad":
            labels[input_ids == self.pad_id] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}
