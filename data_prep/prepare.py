"""Prepare a pre-training corpus: documents -> SentencePiece tokenizer -> memmap token shards + meta.json.

    python -m data_prep.prepare --source stdlib-docs --out data/stdlib [--vocab-size 4096]
        [--tokenizer-type bpe|unigram] [--tokenizer DIR_OR_.model] [--mode packed|truncate_pad] [--seq-len 256]
        [--val-fraction 0.02] [--num-proc N] [--max-docs N] [--seed 0] [--tokenizer-train-chars N]
        [--encoding utf-8] [--errors strict|replace|ignore]

Writes into DIR: `tokenizer/` (SentencePiece model plus the HF files, `AutoTokenizer.from_pretrained(DIR/tokenizer)`
loads it), `train.bin`, `val.bin` and `meta.json` (written last: a directory without it is not a finished
preparation). Owns the split, the shard layout and the meta fields; distsparse/data/dataset.py reads them.
DESIGN s6 (data modes), research/pretraining_ecosystem.md s2 (nanoGPT/Megatron-style flat token files).

Shard layout. Every document is tokenized and followed by EOS (no BOS: documents are separated by EOS only, as
nanoGPT, Megatron `--append-eod` and the T5 tokenizer of the GaLore protocol do).
- `packed`: one flat stream of all documents; a sample is any seq_len window (no token wasted).
- `truncate_pad`: one row of exactly seq_len tokens per document: cut to seq_len - 1 tokens plus EOS (the GaLore
  C4 protocol keeps EOS last after truncation), then padded with pad_id; the loss is masked at pad.
The validation split is a seeded random set of whole documents (no document is in both splits).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import datasets
import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from data_prep.sources import ERRORS, TextOptions, load_documents, parse_source
from data_prep.tokenizer import (
    MODEL_FILE, TOKENIZER_TYPES, check_hf_tokenizer, resolve_model_file, save_hf_tokenizer, sha256_file, special_ids,
    train_sentencepiece,
)

log = logging.getLogger(__name__)

MODES = ("packed", "truncate_pad")
DEFAULT_VOCAB_SIZE = 4096
TOKENIZER_DIR = "tokenizer"
HF_CHECK_DOCS = 200  # validation documents re-encoded through the HF tokenizer as a check
_COUNT_CHUNK = 1 << 24  # tokens per bincount chunk, so frequency counting never loads a whole shard


@dataclasses.dataclass(kw_only=True)
class PrepConfig:
    """Arguments of one preparation; the CLI flags carry the same names with dashes."""

    source: str                       # stdlib-docs | hf:NAME[:CONFIG] | files:GLOB
    out: Path                         # output directory
    vocab_size: int | None = None     # tokenizer training only; DEFAULT_VOCAB_SIZE when None
    tokenizer_type: str = "bpe"       # LLaMA's choice; also ~4x faster to train than unigram here
    tokenizer: str | None = None      # existing .model file or directory holding tokenizer.model
    mode: str = "packed"
    seq_len: int = 256                # truncate_pad row length; packed: the eval sample length of meta's PPL
    val_fraction: float = 0.02        # share of documents held out
    num_proc: int = max(1, min(8, os.cpu_count() or 1))
    max_docs: int | None = None       # first N documents of the source
    seed: int = 0
    tokenizer_train_chars: int = 3_000_000  # bounds tokenizer training time (a seeded sample of train lines)
    encoding: str = "utf-8"           # files: sources only
    errors: str = "strict"            # files: sources: strict | replace | ignore undecodable bytes

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        parse_source(self.source)  # raises on an unknown scheme
        TextOptions(self.encoding, self.errors)  # raises on an unknown codec or errors mode
        if self.mode not in MODES:
            raise ValueError(f"--mode: got {self.mode!r}; allowed: {', '.join(MODES)}")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise ValueError(f"--tokenizer-type: got {self.tokenizer_type!r}; allowed: {', '.join(TOKENIZER_TYPES)}")
        if self.seq_len < 2:
            raise ValueError(f"--seq-len: got {self.seq_len}; allowed: >= 2")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction: got {self.val_fraction}; allowed: 0 < value < 1")
        if self.num_proc < 1:
            raise ValueError(f"--num-proc: got {self.num_proc}; allowed: >= 1")
        if self.max_docs is not None and self.max_docs < 2:
            raise ValueError(f"--max-docs: got {self.max_docs}; allowed: >= 2 (one train and one val document)")
        if self.tokenizer_train_chars < 1:
            raise ValueError(f"--tokenizer-train-chars: got {self.tokenizer_train_chars}; allowed: >= 1")
        if self.tokenizer is not None:
            resolve_model_file(self.tokenizer)  # fail before any document is read
        if self.tokenizer is not None and self.vocab_size is not None:
            raise ValueError(f"--vocab-size: got {self.vocab_size} together with --tokenizer {self.tokenizer!r}; "
                             "allowed: one of them (a given tokenizer fixes the vocabulary)")


def prepare(cfg: PrepConfig) -> dict:
    """Run the whole preparation; return the meta dict also written to `cfg.out/meta.json`."""
    started = time.perf_counter()
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "meta.json").unlink(missing_ok=True)

    docs = load_documents(parse_source(cfg.source), max_docs=cfg.max_docs, num_proc=cfg.num_proc,
                          text=TextOptions(cfg.encoding, cfg.errors))
    if len(docs) == 0:
        raise ValueError(f"--source {cfg.source}: no documents in it; allowed: a source with non-blank text")
    train_idx, val_idx = split_documents(len(docs), cfg.val_fraction, cfg.seed)
    splits = {"train": docs.select(train_idx), "val": docs.select(val_idx)}
    log.info("documents: %d train, %d val", len(train_idx), len(val_idx))

    model_file = install_tokenizer(cfg, splits["train"])
    processor = spm.SentencePieceProcessor(model_file=str(model_file))
    ids = special_ids(processor)
    check_docs = list(splits["val"].select(range(min(HF_CHECK_DOCS, len(val_idx))))["text"])
    check = check_hf_tokenizer(model_file.parent, processor, check_docs)
    if check["id_mismatch"]:
        log.warning("the HF tokenizer encodes %d of %d checked documents to other ids than sentencepiece "
                    "(equal-score unigram segmentations; both decode alike)", check["id_mismatch"], len(check_docs))
    if check["lossy"]:
        log.warning("the tokenizer does not reproduce %d of %d checked documents exactly (its normalization "
                    "changes text)", check["lossy"], len(check_docs))

    vocab_size = processor.get_piece_size()
    # uint16 holds ids 0..65535, i.e. any vocabulary of up to 2^16 pieces, at half the bytes of uint32.
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    num_tokens = {}
    for name, split in splits.items():
        encoded = split.map(
            _encode_batch, batched=True, batch_size=1000, num_proc=min(cfg.num_proc, len(split)),
            remove_columns=split.column_names, load_from_cache_file=False, desc=f"tokenize {name}",
            fn_kwargs={"model_file": str(model_file), "eos_id": ids["eos_id"],
                       "max_len": cfg.seq_len if cfg.mode == "truncate_pad" else None})
        num_tokens[name] = write_shard(encoded, cfg.out / f"{name}.bin", dtype=dtype, mode=cfg.mode,
                                       seq_len=cfg.seq_len, pad_id=ids["pad_id"])

    train = read_shard(cfg.out / "train.bin", dtype, cfg.mode, cfg.seq_len)
    val = read_shard(cfg.out / "val.bin", dtype, cfg.mode, cfg.seq_len)
    ppl = unigram_perplexity(token_counts(train, vocab_size, cfg.mode, ids["pad_id"]),
                             scored_targets(val, cfg.mode, cfg.seq_len, ids["pad_id"]))
    meta = {
        "vocab_size": vocab_size,
        "tokenizer_sha256": sha256_file(model_file),
        "tokenizer_dir": TOKENIZER_DIR,
        "tokenizer_type": cfg.tokenizer_type if cfg.tokenizer is None else f"given:{cfg.tokenizer}",
        "tokenizer_check": check,
        "dtype": np.dtype(dtype).name,
        "mode": cfg.mode,
        "seq_len": cfg.seq_len,
        "source": cfg.source,
        "max_docs": cfg.max_docs,
        "seed": cfg.seed,
        "val_fraction": cfg.val_fraction,
        "num_docs": {"train": len(train_idx), "val": len(val_idx)},
        "num_tokens": num_tokens,
        **ids,
        "unigram_val_ppl": ppl,
    }
    tmp = cfg.out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(cfg.out / "meta.json")
    log.info("done in %.1f s: %s", time.perf_counter() - started,
             json.dumps({k: meta[k] for k in ("vocab_size", "num_docs", "num_tokens", "unigram_val_ppl")}))
    return meta


def install_tokenizer(cfg: PrepConfig, train_docs: datasets.Dataset) -> Path:
    """Train (or take `cfg.tokenizer`), write `cfg.out/tokenizer/`, check its special ids; return its .model."""
    if cfg.tokenizer is None:
        vocab_size = cfg.vocab_size or DEFAULT_VOCAB_SIZE
        t0 = time.perf_counter()
        trained = train_sentencepiece(
            tokenizer_sentences(train_docs, cfg.tokenizer_train_chars, cfg.seed), cfg.out / "spm.model",
            vocab_size=vocab_size, model_type=cfg.tokenizer_type, seed=cfg.seed, num_threads=cfg.num_proc)
        log.info("tokenizer: trained %s, vocab %d, in %.1f s", cfg.tokenizer_type, vocab_size,
                 time.perf_counter() - t0)
        save_hf_tokenizer(trained, cfg.out / TOKENIZER_DIR)
        trained.unlink()  # the copy in the tokenizer folder is the one meta.json describes
    else:
        save_hf_tokenizer(resolve_model_file(cfg.tokenizer), cfg.out / TOKENIZER_DIR)
    model_file = cfg.out / TOKENIZER_DIR / MODEL_FILE
    ids = special_ids(spm.SentencePieceProcessor(model_file=str(model_file)))
    if ids["eos_id"] < 0:
        raise ValueError(f"--tokenizer: {cfg.tokenizer} has no EOS piece; allowed: a model with eos_id >= 0")
    if cfg.mode == "truncate_pad" and ids["pad_id"] < 0:
        raise ValueError(f"--tokenizer: {cfg.tokenizer} has no pad piece; --mode truncate_pad needs one "
                         "(allowed: a model trained with pad_id >= 0, or --mode packed)")
    return model_file


def split_documents(num_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) document indices, each ascending; val is a seeded random round(val_fraction * n) >= 1 docs."""
    num_val = max(1, round(val_fraction * num_docs))
    if num_val >= num_docs:
        raise ValueError(f"--val-fraction {val_fraction} leaves no training document out of {num_docs}; "
                         "allowed: a source with more documents or a smaller fraction")
    perm = np.random.default_rng(seed).permutation(num_docs)
    return sorted(perm[num_val:].tolist()), sorted(perm[:num_val].tolist())


def tokenizer_sentences(train_docs: datasets.Dataset, max_chars: int, seed: int) -> Iterator[str]:
    """Non-blank lines of train documents in a seeded order, about `max_chars` characters in all.

    Lines suffice because "\\n" is a user-defined piece that no learned piece can span.
    """
    used = 0
    for batch in train_docs.shuffle(seed=seed).iter(batch_size=1000):
        for line in itertools.chain.from_iterable(text.split("\n") for text in batch["text"]):
            if line.strip():
                yield line
                used += len(line)
                if used >= max_chars:
                    return


def _encode_batch(batch: dict, *, model_file: str, eos_id: int, max_len: int | None) -> dict:
    # Loaded per batch (a few ms) so that no processor object has to travel to the map workers.
    processor = spm.SentencePieceProcessor(model_file=model_file, num_threads=1)
    encoded = processor.encode(batch["text"])
    if max_len is None:
        ids = [doc + [eos_id] for doc in encoded]
    else:
        ids = [doc[: max_len - 1] + [eos_id] for doc in encoded]
    return {"ids": ids, "len": [len(doc) for doc in ids]}


def write_shard(encoded: datasets.Dataset, path: Path, *, dtype: type, mode: str, seq_len: int, pad_id: int) -> int:
    """Write a split's token ids to `path` (flat stream, or [num_docs, seq_len] rows); return its non-pad count."""
    lengths = np.asarray(encoded["len"], dtype=np.int64)
    num_tokens = int(lengths.sum())
    shape = (num_tokens,) if mode == "packed" else (len(lengths), seq_len)
    out = np.memmap(path, dtype=dtype, mode="w+", shape=shape)
    if mode == "truncate_pad":
        out[:] = pad_id
    pos = 0
    with tqdm(total=len(lengths), desc=f"write {path.name}", unit="doc") as bar:
        for batch in encoded.iter(batch_size=4096):
            if mode == "packed":
                flat = np.fromiter(itertools.chain.from_iterable(batch["ids"]), dtype=dtype, count=sum(batch["len"]))
                out[pos: pos + flat.size] = flat
                pos += flat.size
            else:
                for ids in batch["ids"]:
                    out[pos, : len(ids)] = ids
                    pos += 1
            bar.update(len(batch["ids"]))
    out.flush()
    return num_tokens


def read_shard(path: Path, dtype: type, mode: str, seq_len: int) -> np.ndarray:
    """A shard as a read-only memmap: flat (packed) or [rows, seq_len] (truncate_pad)."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return tokens if mode == "packed" else tokens.reshape(-1, seq_len)


def token_counts(tokens: np.ndarray, vocab_size: int, mode: str, pad_id: int) -> np.ndarray:
    """int64 [vocab_size] frequency of every non-pad token of a shard, counted in chunks."""
    flat = tokens.reshape(-1)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, flat.size, _COUNT_CHUNK):
        chunk = np.asarray(flat[start: start + _COUNT_CHUNK])
        if mode == "truncate_pad":
            chunk = chunk[chunk != pad_id]
        counts += np.bincount(chunk, minlength=vocab_size)
    return counts


def scored_targets(tokens: np.ndarray, mode: str, seq_len: int, pad_id: int) -> np.ndarray:
    """The tokens a model is scored on when it reads this shard as TokenDataset(split, seq_len) samples.

    HF LlamaForCausalLM shifts labels inside the model, so position 0 of every sample is never a target; pad
    positions are masked (-100); packed tokens past the last whole sample are not in any sample.
    """
    rows = tokens.reshape(-1)[: tokens.size // seq_len * seq_len].reshape(-1, seq_len)[:, 1:]
    return np.asarray(rows[rows != pad_id] if mode == "truncate_pad" else rows.reshape(-1))


def unigram_perplexity(train_counts: np.ndarray, targets: np.ndarray) -> float:
    """exp of the mean negative log-probability of `targets` under add-one-smoothed train frequencies.

    p(v) = (count(v) + 1) / (N + V): the context-free floor that any language model must beat.
    """
    if targets.size == 0:
        raise ValueError("the validation split holds no whole sample of seq_len tokens; "
                         "allowed: a larger --val-fraction, more documents or a smaller --seq-len")
    log_p = np.log((train_counts.astype(np.float64) + 1.0) / (train_counts.sum() + train_counts.size))
    return float(math.exp(-log_p[targets.astype(np.int64)].mean()))


def parse_args(argv: list[str] | None = None) -> PrepConfig:
    parser = argparse.ArgumentParser(prog="python -m data_prep.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="stdlib-docs | hf:NAME[:CONFIG] | files:GLOB")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--vocab-size", type=int, help=f"trained tokenizer size (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=PrepConfig.tokenizer_type)
    parser.add_argument("--tokenizer", help="existing SentencePiece .model or a directory holding tokenizer.model")
    parser.add_argument("--mode", choices=MODES, default=PrepConfig.mode)
    parser.add_argument("--seq-len", type=int, default=PrepConfig.seq_len)
    parser.add_argument("--val-fraction", type=float, default=PrepConfig.val_fraction)
    parser.add_argument("--num-proc", type=int, default=PrepConfig.num_proc)
    parser.add_argument("--max-docs", type=int, help="use only the first N documents of the source")
    parser.add_argument("--seed", type=int, default=PrepConfig.seed)
    parser.add_argument("--tokenizer-train-chars", type=int, default=PrepConfig.tokenizer_train_chars,
                        help="characters of train text the tokenizer is trained on (bounds training time)")
    parser.add_argument("--encoding", default=PrepConfig.encoding, help="codec of files: sources (default utf-8)")
    parser.add_argument("--errors", choices=ERRORS, default=PrepConfig.errors,
                        help="undecodable bytes in files: sources: strict (refuse, naming the file and offset), "
                             "replace (U+FFFD), ignore (drop); a file mostly undecodable is refused as not text")
    args = parser.parse_args(argv)
    return PrepConfig(**{k.replace("-", "_"): v for k, v in vars(args).items()})


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return prepare(parse_args(argv))


if __name__ == "__main__":
    try:
        main()
    except ValueError as err:   # bad input: one line naming the file or option, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
