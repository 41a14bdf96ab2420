"""The last step of a preparation: the budget's cut, every shard checked against its record, meta.json.

Owns meta.json (written last and atomically: a directory without it is not a finished preparation; the dataset
reads it, distsparse/data/dataset.py) and the unigram PPL floor. Runs where the preparation was started, after the
local workers or the SLURM tasks, in one read pass over the shards (sha256 and train token counts) plus one over
the validation split (PPL): memory is one chunk of tokens and a vocabulary of counts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from data_prep.parts import cut_part, docs_to_keep
from data_prep.plan import SPLITS, Plan, write_json_atomic
from distsparse.data.shards import TokenStream, sha256_file

_READ_BYTES = 1 << 25


def finalize(plan: Plan) -> dict:
    """Cut the last part to the budget, check every shard's sha256 and counts, write meta.json; return it."""
    records = plan.records()
    used, missing = plan.usage(records)
    if missing is not None:
        todo = [i for i in used if i not in records]
        raise ValueError(f"--out {plan.out}: {len(todo)} part(s) of the source are not prepared yet (first: part "
                         f"{missing}, {plan.parts[missing].describe()}); allowed: rerun the same command, which "
                         f"prepares only what is missing")
    docs = sum(records[i]["num_docs"] for i in used[:-1])
    tokens = sum(records[i]["splits"]["train"]["num_tokens"] for i in used[:-1])
    last = used[-1]
    keep = docs_to_keep(plan, last, records[last], docs, tokens)
    if keep < records[last]["num_docs"]:
        records[last] = cut_part(plan, last, records[last], keep)

    tok = plan.tokenizer
    counts = np.zeros(tok["vocab_size"], dtype=np.int64)
    shards: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for index in used:
        for split in SPLITS:
            shard = records[index]["splits"][split]
            if shard["num_docs"]:
                _verify(plan, index, shard, counts if split == "train" else None)
                shards[split].append({"file": f"shards/{shard['file']}",
                                      **{k: shard[k] for k in ("num_docs", "num_tokens", "sha256", "index_sha256",
                                                               "max_token_id")}})
    num_docs = {split: sum(s["num_docs"] for s in shards[split]) for split in SPLITS}
    _refuse_empty(plan, num_docs, sum(records[i]["num_docs"] for i in used))
    s = plan.settings
    val = TokenStream([(plan.out / e["file"], e["num_docs"] * s["seq_len"] if s["mode"] == "truncate_pad"
                        else e["num_tokens"]) for e in shards["val"]], np.dtype(tok["dtype"]))
    meta = {
        "vocab_size": tok["vocab_size"],
        "tokenizer_sha256": tok["tokenizer_sha256"],
        "tokenizer_dir": plan.tokenizer_dir.name,
        "tokenizer_kind": tok["kind"],
        "tokenizer_type": tok["type"],
        "tokenizer_check": tok["check"],
        "dtype": tok["dtype"],
        "mode": s["mode"],
        "seq_len": s["seq_len"],
        "source": s["source"],
        "text_key": s["text_key"],
        "max_docs": s["max_docs"],
        "max_tokens": s["max_tokens"],
        "seed": s["seed"],
        "val_fraction": s["val_fraction"],
        "num_parts": len(used),
        "num_docs": num_docs,
        "num_tokens": {split: sum(e["num_tokens"] for e in shards[split]) for split in SPLITS},
        "max_token_id": max(e["max_token_id"] for split in SPLITS for e in shards[split]),
        **{key: tok[key] for key in ("bos_id", "eos_id", "pad_id", "unk_id")},
        "unigram_val_ppl": unigram_val_ppl(counts, val, s["mode"], s["seq_len"], tok["pad_id"]),
        "shards": shards,
    }
    if meta["max_token_id"] >= meta["vocab_size"]:
        raise ValueError(f"--tokenizer: the shards hold token id {meta['max_token_id']}, but the tokenizer's vocabulary "
                         f"has {meta['vocab_size']} ids; allowed: a tokenizer whose ids are below its vocabulary size")
    write_json_atomic(plan.out / "meta.json", meta)
    remove_unused(plan, used, records)
    return meta


def _verify(plan: Plan, index: int, shard: dict, counts: np.ndarray | None) -> None:
    """The shard's sha256 (and its index's) against the record; add its non-pad token counts to `counts`."""
    path = plan.out / "shards" / shard["file"]
    dtype = np.dtype(plan.tokenizer["dtype"])
    pad = plan.tokenizer["pad_id"] if plan.settings["mode"] == "truncate_pad" else None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(_READ_BYTES):
            digest.update(data)
            if counts is not None:
                ids = np.frombuffer(data, dtype=dtype)
                counts += np.bincount(ids if pad is None else ids[ids != pad], minlength=counts.size)[: counts.size]
    if digest.hexdigest() != shard["sha256"] or sha256_file(path.with_suffix(".idx")) != shard["index_sha256"]:
        plan.record_path(index).unlink(missing_ok=True)
        raise ValueError(f"{path}: its sha256 is not the one in {plan.record_path(index)} (damaged on disk, or written "
                         f"by two preparations at once); the part is discarded; allowed: rerun the same command, "
                         f"which prepares it again")


def _refuse_empty(plan: Plan, num_docs: dict[str, int], total: int) -> None:
    s = plan.settings
    if total == 0:
        files = sorted({p.path for p in plan.parts if p.path}) or [s["source"]]
        raise ValueError(f"--source {s['source']}: no documents in {', '.join(files)}; allowed: a source with "
                         "non-blank text")
    for split, other in (("val", "train"), ("train", "val")):
        if num_docs[split] == 0:
            raise ValueError(f"--val-fraction {s['val_fraction']}: the {split} split got none of the {total} "
                             f"documents (all went to {other}); allowed: more documents or a "
                             f"{'larger' if split == 'val' else 'smaller'} fraction")


def unigram_val_ppl(train_counts: np.ndarray, val: TokenStream, mode: str, seq_len: int, pad_id: int) -> float:
    """exp of the mean negative log-probability, under add-one-smoothed train frequencies p(v) = (count(v) + 1) /
    (N + V), of the tokens a model is scored on when it reads the val split as TokenDataset(val, seq_len) samples:
    HF LlamaForCausalLM shifts labels inside the model, so position 0 of every sample is never a target; pad
    positions are masked; packed tokens past the last whole sample are in no sample. The context-free floor that
    any language model must beat."""
    log_p = np.log((train_counts.astype(np.float64) + 1.0) / (train_counts.sum() + train_counts.size))
    usable = len(val) // seq_len * seq_len
    if usable == 0:
        raise ValueError("the validation split holds no whole sample of seq_len tokens; "
                         "allowed: a larger --val-fraction, more documents or a smaller --seq-len")
    total, count = 0.0, 0
    rows_per_read = max(1, (1 << 22) // seq_len)
    for start in range(0, usable, rows_per_read * seq_len):
        rows = val.read(start, min(usable, start + rows_per_read * seq_len)).reshape(-1, seq_len)[:, 1:]
        targets = rows[rows != pad_id] if mode == "truncate_pad" else rows.reshape(-1)
        total -= float(log_p[targets.astype(np.int64)].sum())
        count += targets.size
    return float(math.exp(total / count))


def remove_unused(plan: Plan, used: list[int], records: dict[int, dict]) -> None:
    """Records of parts past the budget and shard files no record of a used part names (a cut part's uncut files,
    a killed worker's .partial files)."""
    keep = {f for i in used for shard in records[i]["splits"].values()
            for f in (shard["file"], Path(shard["file"]).with_suffix(".idx").name)}
    for index in range(len(plan.parts)):
        if index not in used:
            plan.record_path(index).unlink(missing_ok=True)
    for entry in os.scandir(plan.out / "shards"):
        if entry.name not in keep:
            os.unlink(entry.path)


def read_meta(out: Path) -> dict:
    return json.loads((Path(out) / "meta.json").read_text())
