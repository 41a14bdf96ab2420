"""Checks of a run against its prepared data, before any process group starts (issue 30 item 2).

Owns three refusals and one warning that would otherwise surface as tracebacks after DeepSpeed has started:
- a model vocabulary at or below the largest token id in the shards (an IndexError in the embedding mid-run) is
  refused; one above the largest id + 1 is warned about (embedding rows that never see a token: normal for a
  tokenizer's reserved ids, a mistake for a vocabulary typed by hand);
- a global batch (the run's BatchPlan, train/batch.py) larger than the training samples;
- a negative train.seed (numpy's SeedSequence, which orders the data, refuses it).
Written against today's config fields; validate.py calls it with the world size the launcher gives.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from distsparse.data.shards import TokenStream, split_files
from distsparse.train.batch import BatchPlan

log = logging.getLogger(__name__)
_SCAN_TOKENS = 1 << 24


def largest_token_id(data_dir: str | Path, meta: dict) -> int:
    """meta.json's `max_token_id`; preparations from before it was recorded are scanned (their single train.bin
    and val.bin), a chunk at a time."""
    if "max_token_id" in meta:
        return int(meta["max_token_id"])
    largest = -1
    for split in ("train", "val"):
        stream = TokenStream(split_files(Path(data_dir), meta, split), np.dtype(meta["dtype"]))
        for _, tokens in stream.chunks(_SCAN_TOKENS):
            if meta["mode"] == "truncate_pad":
                tokens = tokens[tokens != meta["pad_id"]]
            if tokens.size:
                largest = max(largest, int(tokens.max()))
    return largest


def check_data(cfg, meta: dict, *, plan: BatchPlan, num_train_samples: int) -> None:
    """ValueError naming the key, the value and what is allowed; a warning for a vocabulary above the data's."""
    t = cfg.train
    if t.seed < 0:
        raise ValueError(f"train.seed: got {t.seed}; allowed: an integer >= 0 (it seeds the data order, numpy's "
                         "SeedSequence, and the initialization)")
    largest = largest_token_id(cfg.data.dir, meta)
    vocab = cfg.model.vocab_size or meta["vocab_size"]
    if vocab <= largest:
        if cfg.model.vocab_size:
            raise ValueError(f"model.vocab_size: got {vocab}; the data in {cfg.data.dir} holds token id {largest}; "
                             f"allowed: >= {largest + 1} (or 0 to take meta.json's vocab_size)")
        raise ValueError(f"data.dir: {cfg.data.dir}/meta.json says vocab_size {vocab}, but its shards hold token id "
                         f"{largest}: the meta.json does not describe these shards; allowed: the files of one "
                         f"finished data_prep.prepare run (re-run it)")
    if vocab > largest + 1:
        log.warning("model vocabulary %d is above the data's largest token id %d + 1: %d embedding rows never see a "
                    "token (expected for a tokenizer's unused or reserved ids; meta.json vocab_size %d)", vocab,
                    largest, vocab - largest - 1, meta["vocab_size"])
    if plan.global_batch > num_train_samples:
        what = (f"train.global_batch_size: got {t.global_batch_size}" if t.global_batch_size else
                f"train.micro_batch: got {t.micro_batch}, a global batch of train.micro_batch x accumulation "
                f"({plan.grad_accum}) x {plan.world_size} rank(s) = {plan.global_batch}")
        raise ValueError(f"{what} sequences, more than the {num_train_samples} training samples of {cfg.data.dir} "
                         f"at data.seq_len {cfg.data.seq_len}; allowed: a global batch <= {num_train_samples}")
