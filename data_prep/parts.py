"""One part of a preparation: its documents streamed in chunks, held out or not, tokenized, written to its shards.

Owns what a worker does (`run_part`) and the budget's cut of the last part (`cut_part`). Memory per worker is one
chunk (at most CHUNK_DOCS documents or CHUNK_CHARS characters, their ids as Python lists and then in the shard
dtype) plus the readers' block: it does not grow with the size of the part or of the corpus.

Shard layout. Every document is tokenized and followed by EOS (no BOS: documents are separated by EOS only, as
nanoGPT, Megatron `--append-eod` and the T5 tokenizer of the GaLore protocol do).
- `packed`: the documents end to end (no token wasted); a sample is any seq_len window of the split's stream.
- `truncate_pad`: one row of exactly seq_len tokens per document: cut to seq_len - 1 tokens plus EOS (the GaLore
  C4 protocol keeps EOS last after truncation), then padded with pad_id; the loss is masked at pad.
The validation split is whole documents: document i of part p is held out when a counter-based hash (SplitMix64)
of (seed, p, i) falls below val_fraction, so the split depends neither on chunking nor on where a budget cuts.
"""

from __future__ import annotations

import itertools
import resource
from typing import Iterable, Iterator

import numpy as np

from data_prep.plan import SPLITS, Plan
from data_prep.sources import part_documents
from data_prep.tokenizer import load_encoder
from distsparse.data.shards import ShardWriter, read_index

CHUNK_DOCS = 1024
CHUNK_CHARS = 1 << 20    # the ids of a chunk as Python ints take about 10x its characters in bytes
_COPY_TOKENS = 1 << 24

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (Steele, Lea, Flood 2014) on uint64 arrays (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def val_mask(seed: int, part: int, first: int, count: int, fraction: float) -> np.ndarray:
    """bool [count]: which of documents first .. first + count - 1 of `part` belong to the validation split."""
    key = _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.array([part], dtype=np.uint64))
    index = np.arange(first, first + count, dtype=np.uint64)
    uniform = (_splitmix64(key ^ _splitmix64(index)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return uniform < fraction


def chunks(docs: Iterable[str], max_docs: int = CHUNK_DOCS, max_chars: int = CHUNK_CHARS) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc)
        if len(chunk) >= max_docs or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def lay_out(ids: list[list[int]], *, mode: str, seq_len: int, eos_id: int, pad_id: int,
            dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens in the shard dtype, int64 lengths) of encoded documents: each + EOS, or truncate_pad rows."""
    if mode == "packed":
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
        ends = np.cumsum(lengths)
        tokens = np.empty(int(ends[-1]) if ids else 0, dtype=dtype)
        is_eos = np.zeros(tokens.size, dtype=bool)
        is_eos[ends - 1] = True
        tokens[is_eos] = eos_id
        tokens[~is_eos] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=tokens.size - len(ids))
        return tokens, lengths
    docs = [doc[: seq_len - 1] + [eos_id] for doc in ids]
    kept = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    rows = np.full((len(docs), seq_len), pad_id, dtype=dtype)
    rows[np.arange(seq_len) < kept[:, None]] = np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype,
                                                           count=int(kept.sum()))
    return rows.reshape(-1), np.full(len(docs), seq_len, dtype=np.int64)


def _writers(plan: Plan, index: int, suffix: str = "") -> dict[str, ShardWriter]:
    tok = plan.tokenizer
    pad = tok["pad_id"] if plan.settings["mode"] == "truncate_pad" else None
    return {split: ShardWriter(plan.shard_path(split, index, suffix), np.dtype(tok["dtype"]), pad) for split in SPLITS}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_part(out: str, index: int) -> tuple[dict, float]:
    """Prepare part `index` of the plan in `out`; return its record (also written to parts/) and this process's
    peak RSS in MiB so far. A part stops early once it alone meets the budget (the last part is cut later)."""
    plan = Plan.load(out)
    s, tok = plan.settings, plan.tokenizer
    encode = load_encoder(str(plan.tokenizer_dir), tok["kind"])
    layout = {"mode": s["mode"], "seq_len": s["seq_len"], "eos_id": tok["eos_id"], "pad_id": tok["pad_id"],
              "dtype": np.dtype(tok["dtype"])}
    writers = _writers(plan, index)
    docs = part_documents(plan.parts[index], plan.read_options)
    num_docs, capped = 0, False
    try:
        for chunk in chunks(docs):
            held_out = val_mask(s["seed"], index, num_docs, len(chunk), s["val_fraction"])
            ids = encode(chunk)
            for split, keep in (("train", ~held_out), ("val", held_out)):
                writers[split].append(*lay_out([ids[i] for i in np.flatnonzero(keep)], **layout))
            num_docs += len(chunk)
            if plan.budget.met(num_docs, writers["train"].num_tokens):
                capped = True
                break
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        getattr(docs, "close", lambda: None)()   # a stopped reader closes its file now
    record = {"part": index, "num_docs": num_docs, "capped": capped,
              "splits": {split: writer.close() for split, writer in writers.items()}}
    plan.write_record(index, record)
    return record, peak_rss_mb()


def train_tokens_per_doc(plan: Plan, record: dict) -> np.ndarray:
    """int64 [train documents of the part]: tokens each counts toward --max-tokens (pad excluded)."""
    path = plan.out / "shards" / record["splits"]["train"]["file"]
    dtype, lengths = read_index(path.with_suffix(".idx"))
    if plan.settings["mode"] == "packed":
        return lengths
    seq_len, pad = plan.settings["seq_len"], plan.tokenizer["pad_id"]
    rows = np.memmap(path, dtype=dtype, mode="r").reshape(-1, seq_len) if lengths.size else np.zeros((0, seq_len))
    step = max(1, _COPY_TOKENS // seq_len)
    return np.concatenate([(rows[a: a + step] != pad).sum(1) for a in range(0, len(rows), step)] or [np.zeros(0)])


def docs_to_keep(plan: Plan, index: int, record: dict, docs_before: int, tokens_before: int) -> int:
    """How many of the part's source documents the budget keeps, given what the parts before it hold."""
    keep = record["num_docs"]
    budget = plan.budget
    if budget.max_docs is not None:
        keep = min(keep, budget.max_docs - docs_before)
    if budget.max_tokens is not None:
        cumulative = np.cumsum(train_tokens_per_doc(plan, record))
        if cumulative.size and cumulative[-1] >= budget.max_tokens - tokens_before:
            train_docs = int(np.searchsorted(cumulative, budget.max_tokens - tokens_before)) + 1
            held_out = val_mask(plan.settings["seed"], index, 0, record["num_docs"], plan.settings["val_fraction"])
            keep = min(keep, int(np.flatnonzero(~held_out)[train_docs - 1]) + 1)
    return keep


def kept_train_tokens(plan: Plan, records: dict[int, dict]) -> int:
    """Training tokens of the output as far as the finished parts tell: the parts it is made of (`plan.usage`) up
    to the first unfinished one, the part that meets the budget counted only up to where finalize cuts it."""
    used, missing = plan.usage(records)
    docs = tokens = 0
    for index in used:
        if index == missing:
            break
        record = records[index]
        keep = docs_to_keep(plan, index, record, docs, tokens)
        if keep < record["num_docs"]:   # finalize's cut_part: the first `keep` source documents
            train_docs = int((~val_mask(plan.settings["seed"], index, 0, keep, plan.settings["val_fraction"])).sum())
            return tokens + int(train_tokens_per_doc(plan, record)[:train_docs].sum())
        docs, tokens = docs + record["num_docs"], tokens + record["splits"]["train"]["num_tokens"]
    return tokens


def cut_part(plan: Plan, index: int, record: dict, keep: int) -> dict:
    """The part's first `keep` source documents as new `-cut` shards, the record switched to them atomically."""
    assert "cut_from" not in record and keep < record["num_docs"], (index, keep, record["num_docs"])
    held_out = val_mask(plan.settings["seed"], index, 0, keep, plan.settings["val_fraction"])
    keep_per_split = {"train": int((~held_out).sum()), "val": int(held_out.sum())}
    writers = _writers(plan, index, "-cut")
    for split, writer in writers.items():
        source = plan.out / "shards" / record["splits"][split]["file"]
        dtype, lengths = read_index(source.with_suffix(".idx"))
        lengths = lengths[: keep_per_split[split]]
        tokens = np.memmap(source, dtype=dtype, mode="r") if lengths.size else np.zeros(0, dtype=dtype)
        start = 0
        ends = np.cumsum(lengths)
        for first in range(0, lengths.size, 4096):   # whole documents, bounded memory
            stop = int(ends[min(lengths.size, first + 4096) - 1])
            writer.append(np.asarray(tokens[start:stop]), lengths[first: first + 4096])
            start = stop
    cut = {**record, "num_docs": keep, "cut_from": record["num_docs"],
           "splits": {split: writer.close() for split, writer in writers.items()}}
    plan.write_record(index, cut)
    return cut
