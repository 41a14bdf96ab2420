"""Token shards on disk: Megatron's indexed format (`.bin` + `.idx`) and a split's shards read as one stream.

Owns the byte layout of a shard and the list of a split's shards in meta.json; data_prep writes shards through
`ShardWriter`, the dataset reads them through `TokenStream`. Does not decide order (sampler.py) or cut samples
(dataset.py).

A shard is Megatron-LM's `IndexedDataset` layout (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`), so
Megatron's `GPTDataset` can train on our shards and shards a lab already holds can be listed in a meta.json:
- `NAME.bin`: the token ids, one document after another (each ending in EOS), in the on-disk dtype;
- `NAME.idx`: b"MMIDIDX\\x00\\x00", version <Q 1, dtype code <B, sequence count <Q, document count <Q, then
  int32 [n] sequence lengths, int64 [n] byte offsets of the sequences, int64 [n + 1] document indices
  (one sequence per document: 0, 1, ..., n).
The format is written here with numpy (about 30 lines) instead of importing megatron-core, whose indexed_dataset
import pulls in about 3,000 modules (12 s per worker process here). Megatron's dtype codes have no uint32: a
vocabulary above 65,536 ids is stored as int32 (the same 4 bytes for any id below 2^31), as Megatron does.

In truncate_pad mode a "document" is one padded row of exactly seq_len tokens.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron/core/datasets/indexed_dataset.py DType
DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}
OPEN_SHARDS = 64   # memmaps a stream keeps open (each holds a file descriptor)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, i.e. any vocabulary of up to 2^16 pieces, at half the bytes of a 4-byte id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def write_index(path: Path, lengths: np.ndarray, dtype: np.dtype) -> None:
    """The `.idx` of a shard whose documents have `lengths` tokens each (one sequence per document)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[np.dtype(dtype).name]))
        f.write(struct.pack("<Q", lengths.size) + struct.pack("<Q", lengths.size + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(lengths.size + 1, dtype=np.int64).tobytes())


def read_index(path: Path) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, int64 [num_sequences] lengths) of a `.idx` file; ValueError naming the file if it is not one."""
    data = Path(path).read_bytes()
    head = len(INDEX_HEADER) + 8 + 1 + 16
    if len(data) < head or not data.startswith(INDEX_HEADER):
        raise ValueError(f"{path}: not a Megatron .idx file (no {INDEX_HEADER!r} header)")
    code = data[len(INDEX_HEADER) + 8]
    names = {v: k for k, v in DTYPE_CODES.items()}
    if code not in names:
        raise ValueError(f"{path}: unknown dtype code {code}; allowed: {sorted(names)}")
    count, _ = struct.unpack_from("<QQ", data, len(INDEX_HEADER) + 9)
    lengths = np.frombuffer(data, dtype=np.int32, count=count, offset=head)
    return np.dtype(names[code]), lengths.astype(np.int64)


class ShardWriter:
    """Appends documents to `PATH.bin.partial`; `close()` writes the `.idx`, renames both into place and returns
    the shard's record (file name, counts, sha256 of both files, largest id). Only the caller's record, written
    after `close()`, says the shard is complete; a killed writer leaves `.partial` files only."""

    def __init__(self, path: Path, dtype: np.dtype, pad_id: int | None = None) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.pad_id = pad_id       # truncate_pad: pad tokens are not counted as tokens
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self.partial, "wb")
        self._sha = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.max_token_id = -1

    def append(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents laid end to end in `tokens` (already the shard dtype), `lengths` tokens each."""
        assert tokens.dtype == self.dtype and int(lengths.sum()) == tokens.size, (tokens.dtype, lengths.sum())
        if tokens.size == 0:
            return
        data = tokens.tobytes()
        self._file.write(data)
        self._sha.update(data)
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        counted = tokens if self.pad_id is None else tokens[tokens != self.pad_id]
        self.num_tokens += int(counted.size)
        if counted.size:
            self.max_token_id = max(self.max_token_id, int(counted.max()))

    def close(self) -> dict:
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        index = self.path.with_suffix(".idx")
        index_partial = index.with_name(index.name + ".partial")
        write_index(index_partial, lengths, self.dtype)
        for partial, final in ((self.partial, self.path), (index_partial, index)):
            os.replace(partial, final)
        return {"file": self.path.name, "num_docs": int(lengths.size), "num_tokens": self.num_tokens,
                "bytes": int(lengths.sum()) * self.dtype.itemsize, "sha256": self._sha.hexdigest(),
                "index_sha256": sha256_file(index), "max_token_id": self.max_token_id}

    def abort(self) -> None:
        self._file.close()
        self.partial.unlink(missing_ok=True)


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def split_files(data_dir: Path, meta: dict, split: str) -> list[tuple[Path, int]]:
    """(file, tokens stored in it) of a split's shards in stream order: meta.json's `shards` list, or the single
    `SPLIT.bin` of preparations made before shards existed (its size then comes from the file)."""
    dtype = np.dtype(meta["dtype"])
    shards = meta.get("shards")
    if shards is None:
        path = Path(data_dir) / f"{split}.bin"
        return [(path, path.stat().st_size // dtype.itemsize if path.is_file() else 0)]
    row = meta["seq_len"] if meta["mode"] == "truncate_pad" else None
    return [(Path(data_dir) / s["file"], s["num_docs"] * row if row else s["num_tokens"]) for s in shards[split]]


class TokenStream:
    """A split's shards as one read-only token sequence: `len(stream)`, `stream[a:b]` (a copy, across shards).

    Memmaps open on first use, at most OPEN_SHARDS at a time, and are not pickled (DataLoader workers reopen)."""

    def __init__(self, files: list[tuple[Path, int]], dtype: np.dtype) -> None:
        self.files = [(Path(p), n) for p, n in files if n > 0]
        self.dtype = np.dtype(dtype)
        self.ends = np.cumsum([n for _, n in self.files], dtype=np.int64)
        self._open: OrderedDict[int, np.memmap] = OrderedDict()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}

    def __len__(self) -> int:
        return int(self.ends[-1]) if self.ends.size else 0

    def _shard(self, k: int) -> np.memmap:
        if k in self._open:
            self._open.move_to_end(k)
        else:
            path, num = self.files[k]
            self._open[k] = np.memmap(path, dtype=self.dtype, mode="r", shape=(num,))
            if len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[k]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, concatenated from the shards they lie in."""
        assert 0 <= start <= stop <= len(self), (start, stop, len(self))
        pieces = []
        k = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            first = int(self.ends[k - 1]) if k else 0
            take = min(stop, int(self.ends[k])) - start
            pieces.append(np.asarray(self._shard(k)[start - first: start - first + take]))
            start += take
            k += 1
        if not pieces:
            return np.zeros(0, dtype=self.dtype)
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        assert step == 1, "TokenStream slices are contiguous"
        return self.read(start, max(start, stop))

    def chunks(self, size: int):
        """(offset, tokens) pieces of at most `size` tokens covering the stream in order (bounded memory)."""
        for start in range(0, len(self), size):
            yield start, self.read(start, min(len(self), start + size))
