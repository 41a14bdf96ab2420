"""Prepare a pre-training corpus: documents -> tokenizer -> token shards + meta.json, streamed, in parallel,
resumable, on one machine or across SLURM nodes.

    python -m data_prep.prepare --source stdlib-docs | hf:NAME[:CONFIG] | files:GLOB --out DIR
        [--tokenizer FILE_DIR_OR_HUB_NAME | --vocab-size N --tokenizer-type bpe|unigram]
        [--mode packed|truncate_pad] [--seq-len 256] [--val-fraction 0.02] [--max-docs N] [--max-tokens N]
        [--text-key text] [--format auto|jsonl|parquet|text] [--num-proc N] [--executor local|slurm|submitit-local]

Writes into DIR: `tokenizer/` (`AutoTokenizer.from_pretrained(DIR/tokenizer)` loads it), `shards/` (Megatron
`.bin`/`.idx` per part and split, distsparse/data/shards.py), `parts/` and `prep.json` (progress), and `meta.json`,
written last: a directory without it is not a finished preparation. Running the same command again continues a
killed or unfinished preparation from its finished parts and ends with the same files as an uninterrupted run;
another command into the same DIR is refused naming the settings that differ (`--overwrite` starts over).
`--num-proc` and the executor do not change the output. DESIGN s6 (data modes), decision 23.

How it runs (sources.py, parts.py, finalize.py): the source is planned into parts (files, byte ranges, row groups,
dataset shards); a given tokenizer is installed or one is trained on a sample spread over the parts; a pool of
`--num-proc` workers (or SLURM array tasks, data_prep/slurm.py) each stream a part in chunks, tokenize it and write
its shards in the on-disk dtype, so memory per worker does not depend on the corpus size; a part is skipped once
the parts before it meet `--max-docs`/`--max-tokens`, and the final step cuts the last part to the budget, checks
every shard's sha256 and writes meta.json.

Why not datatrove or Megatron's preprocess_data.py (evaluated for issue 30): datatrove (0.10.1, installable here,
3 new packages) has the right shape (readers for jsonl/parquet/HF, a token-shard writer, local and SLURM executors,
restart by completed task) and this module takes that shape, but its tokenizer step takes only HF `tokenizers`
(no SentencePiece `.model`, this project's default and T5's for the GaLore recipe), it has no global token budget
(its reader `limit` counts documents per task) and no whole-document validation split, its SLURM executor writes
its own sbatch scripts (the project launches through submitit, testable with submitit's local executor), and it
shuffles documents inside each file by default (a second write). Megatron-core gives the shard format
(`.bin`/`.idx`, which many labs already hold): it is written here with numpy because importing megatron-core's
indexed_dataset loads ~3,000 modules (12 s per worker); its preprocess_data.py reads one file through one
process pool with no resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from data_prep.finalize import finalize, read_meta, remove_unused
from data_prep.parts import chunks, kept_train_tokens, peak_rss_mb, run_part, val_mask
from data_prep.plan import PLAN_FILE, OutLock, Plan, write_json_atomic
from data_prep.readers import ERRORS, FORMATS, ReadOptions, TextOptions
from data_prep.sources import parse_source, part_documents, plan_parts
from data_prep.tokenizer import (
    TOKENIZER_TYPES, given_kind, install_given, save_hf_tokenizer, tokenizer_check, tokenizer_facts,
    train_sentencepiece,
)
from data_prep.workers import worker_pool
from distsparse.data.shards import token_dtype
from distsparse.utils import config_differences

log = logging.getLogger(__name__)

MODES = ("packed", "truncate_pad")
DEFAULT_VOCAB_SIZE = 4096
HF_CHECK_DOCS = 200      # validation documents re-encoded through the HF view of the tokenizer as a check
SAMPLED_PARTS = 64       # parts the tokenizer sample and the check documents are drawn from, spread evenly
EXECUTORS = ("local", "slurm", "submitit-local")
# Settings that do not change the output (a preparation may continue under other values).
RUN_ONLY = ("out", "num_proc", "overwrite", "report")


@dataclasses.dataclass(kw_only=True)
class PrepConfig:
    """Arguments of one preparation; the CLI flags carry the same names with dashes."""

    source: str                       # stdlib-docs | hf:NAME[:CONFIG] | files:GLOB
    out: Path                         # output directory
    vocab_size: int | None = None     # tokenizer training only; DEFAULT_VOCAB_SIZE when None
    tokenizer_type: str = "bpe"       # LLaMA's choice; also ~4x faster to train than unigram here
    tokenizer: str | None = None      # SentencePiece .model, a tokenizer directory, or a HF hub name
    mode: str = "packed"
    seq_len: int = 256                # truncate_pad row length; packed: the eval sample length of meta's PPL
    val_fraction: float = 0.02        # share of documents held out (each document independently)
    num_proc: int = max(1, min(8, os.cpu_count() or 1))
    max_docs: int | None = None       # the first N documents of the source
    max_tokens: int | None = None     # the shortest prefix of the source with at least N training tokens
    seed: int = 0
    tokenizer_train_chars: int = 3_000_000  # bounds tokenizer training time (a sample spread over the source)
    encoding: str = "utf-8"           # files: sources only
    errors: str = "strict"            # files: sources: strict | replace | ignore undecodable bytes
    text_key: str = "text"            # the JSON / parquet / HF field holding each document
    format: str = "auto"              # files: sources: kind by name (auto) or forced for every file
    part_bytes: int = 1 << 27         # uncompressed JSON lines and parquet are cut into parts of about this size
    overwrite: bool = False           # start over in an --out that holds another preparation
    report: Path | None = None        # write this invocation's timings and peak memory as JSON

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        parse_source(self.source)  # raises on an unknown scheme
        ReadOptions(TextOptions(self.encoding, self.errors), self.text_key, self.format)  # raises on bad values
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
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--max-tokens: got {self.max_tokens}; allowed: >= 1")
        if self.tokenizer_train_chars < 1:
            raise ValueError(f"--tokenizer-train-chars: got {self.tokenizer_train_chars}; allowed: >= 1")
        if self.part_bytes < 1 << 16:
            raise ValueError(f"--part-bytes: got {self.part_bytes}; allowed: >= {1 << 16}")
        if self.tokenizer is not None:
            given_kind(self.tokenizer)  # fail before any document is read
        if self.tokenizer is not None and self.vocab_size is not None:
            raise ValueError(f"--vocab-size: got {self.vocab_size} together with --tokenizer {self.tokenizer!r}; "
                             "allowed: one of them (a given tokenizer fixes the vocabulary)")

    def settings(self) -> dict:
        """Everything that changes the output, as recorded in prep.json."""
        values = {k: v for k, v in dataclasses.asdict(self).items() if k not in RUN_ONLY}
        if self.tokenizer is None:
            values["vocab_size"] = self.vocab_size or DEFAULT_VOCAB_SIZE
        else:
            del values["tokenizer_train_chars"], values["tokenizer_type"]
        return values

    @property
    def read_options(self) -> ReadOptions:
        return ReadOptions(TextOptions(self.encoding, self.errors), self.text_key, self.format)


Runner = Callable[[Plan], list[float]]   # runs the plan's missing parts; returns the workers' peak RSS (MiB)


def prepare(cfg: PrepConfig, runner: Runner | None = None) -> dict:
    """Run (or continue) the whole preparation; return the meta dict also written to `cfg.out/meta.json`."""
    times = {"start": time.perf_counter()}
    cfg.out.mkdir(parents=True, exist_ok=True)
    with OutLock(cfg.out):
        plan = open_plan(cfg)
        if (cfg.out / "meta.json").is_file():
            log.info("%s is already prepared (same settings): nothing to do", cfg.out)
            records = plan.records()
            remove_unused(plan, plan.usage(records)[0], records)   # what a kill after meta.json left behind
            return read_meta(cfg.out)
        times["plan"] = time.perf_counter()
        if plan.tokenizer is None:
            plan.tokenizer = install_tokenizer(cfg, plan)
            plan.save()
        times["tokenizer"] = time.perf_counter()
        worker_rss = (runner or local_runner(cfg.num_proc))(plan)
        times["parts"] = time.perf_counter()
        meta = finalize(plan)
        times["finalize"] = time.perf_counter()
    seconds = {k: times[k] - times[p] for p, k in zip(list(times)[:-1], list(times)[1:])}
    total = times["finalize"] - times["start"]
    report = {"seconds": {**seconds, "total": total}, "num_proc": cfg.num_proc, "parts_run": len(worker_rss),
              "num_tokens": meta["num_tokens"], "tokens_per_s": sum(meta["num_tokens"].values()) / total,
              "peak_rss_mb": {"main": peak_rss_mb(), "worker_max": max(worker_rss, default=None)}}
    log.info("done in %.1f s: %s; %s", total, json.dumps({k: meta[k] for k in ("vocab_size", "num_docs", "num_tokens",
                                                                               "unigram_val_ppl")}), json.dumps(report))
    if cfg.report:
        write_json_atomic(Path(cfg.report), report)
    return meta


def open_plan(cfg: PrepConfig) -> Plan:
    """The plan in `cfg.out` when it has the same settings; a new one where there is none, nothing finished yet,
    or --overwrite; otherwise a ValueError naming the settings that differ."""
    settings = cfg.settings()
    existing = Plan.load(cfg.out)
    if existing is not None and existing.settings == settings and not cfg.overwrite:
        return existing
    finished = (cfg.out / "meta.json").is_file() or any((cfg.out / "parts").glob("*.json"))
    if existing is not None and finished and not cfg.overwrite:
        said = "; ".join(f"{key}: {there!r} there, {now!r} now"
                         for key, (there, now) in config_differences(existing.settings, settings).items())
        raise ValueError(f"--out: {cfg.out} holds a preparation with other settings ({said}); allowed: the same "
                         f"command (continues it), another --out, or --overwrite (starts over)")
    for name in ("meta.json", PLAN_FILE, "train.bin", "val.bin"):   # the last two: the layout before shards
        (cfg.out / name).unlink(missing_ok=True)
    for folder in ("parts", "shards", "tokenizer"):
        shutil.rmtree(cfg.out / folder, ignore_errors=True)
    plan = Plan(cfg.out, settings, plan_parts(parse_source(cfg.source), cfg.read_options, cfg.part_bytes))
    plan.save()
    log.info("%s: %d parts", cfg.source, len(plan.parts))
    return plan


def install_tokenizer(cfg: PrepConfig, plan: Plan) -> dict:
    """Install the given tokenizer or train one on a sample of training documents; return prep.json's record of
    it (kind, vocabulary, special ids, sha256, shard dtype, the HF check)."""
    if cfg.tokenizer is not None:
        kind = install_given(cfg.tokenizer, plan.tokenizer_dir)   # before any document is read
        lines, check_docs = sample_documents(plan, 0, HF_CHECK_DOCS, cfg.num_proc)
        kind_name = f"given:{cfg.tokenizer}"
    else:
        vocab_size = cfg.vocab_size or DEFAULT_VOCAB_SIZE
        lines, check_docs = sample_documents(plan, cfg.tokenizer_train_chars, HF_CHECK_DOCS, cfg.num_proc)
        if not lines:
            files = sorted({p.path for p in plan.parts if p.path}) or [cfg.source]
            raise ValueError(f"--source {cfg.source}: no documents in {', '.join(files[:20])}; allowed: a source "
                             f"with non-blank text")
        t0 = time.perf_counter()
        # One thread: sentencepiece's model depends on its thread count, the output must not depend on --num-proc
        # (3M characters train in about 2 s).
        trained = train_sentencepiece(lines, cfg.out / "spm.model", vocab_size=vocab_size,
                                      model_type=cfg.tokenizer_type, seed=cfg.seed, num_threads=1)
        log.info("tokenizer: trained %s, vocab %d, in %.1f s", cfg.tokenizer_type, vocab_size,
                 time.perf_counter() - t0)
        save_hf_tokenizer(trained, plan.tokenizer_dir)
        trained.unlink()  # the copy in the tokenizer folder is the one meta.json describes
        kind, kind_name = "sentencepiece", cfg.tokenizer_type
    facts = tokenizer_facts(plan.tokenizer_dir, kind)
    if facts["eos_id"] < 0:
        raise ValueError(f"--tokenizer: {cfg.tokenizer} has no EOS token; allowed: a tokenizer with one (documents "
                         "are separated by EOS)")
    if cfg.mode == "truncate_pad" and facts["pad_id"] < 0:
        raise ValueError(f"--tokenizer: {cfg.tokenizer} has no pad token; --mode truncate_pad needs one (allowed: a "
                         "tokenizer with a pad token, or --mode packed)")
    check = tokenizer_check(plan.tokenizer_dir, kind, check_docs)
    if check.get("id_mismatch"):
        log.warning("the HF tokenizer encodes %d of %d checked documents to other ids than sentencepiece "
                    "(equal-score unigram segmentations; both decode alike)", check["id_mismatch"], len(check_docs))
    if check["lossy"]:
        log.warning("the tokenizer does not reproduce %d of %d checked documents exactly (its normalization "
                    "changes text)", check["lossy"], len(check_docs))
    return {"kind": kind, "type": kind_name, **facts, "dtype": token_dtype(facts["vocab_size"]).name, "check": check}


def sample_documents(plan: Plan, train_chars: int, num_check: int, num_proc: int = 1) -> tuple[list[str], list[str]]:
    """(non-blank lines of training documents, about `train_chars` characters; up to `num_check` validation
    documents). With --max-docs, from the first max-docs documents of the source (the ones kept); otherwise from
    the first documents of SAMPLED_PARTS parts spread over the source, each giving an equal share (read by
    `num_proc` processes).

    Lines suffice for training because "\\n" is a user-defined piece that no learned piece can span."""
    n, limit = len(plan.parts), plan.settings["max_docs"]
    if limit:
        return sample_part(str(plan.out), range(n), train_chars, num_check, limit)
    picked = sorted({int(round(x)) for x in np.linspace(0, n - 1, min(n, SAMPLED_PARTS))})
    jobs = [(str(plan.out), [index], -(-train_chars // len(picked)), -(-num_check // len(picked)), None)
            for index in picked]
    if num_proc > 1:
        with worker_pool(num_proc) as pool:
            samples = pool.starmap(sample_part, jobs)
    else:
        samples = [sample_part(*job) for job in jobs]
    return [line for lines, _ in samples for line in lines], [doc for _, docs in samples for doc in docs][:num_check]


def sample_part(out: str, indices: Iterable[int], train_chars: int, num_check: int,
                limit: int | None) -> tuple[list[str], list[str]]:
    """sample_documents' share from the first documents of parts `indices` (in order; at most `limit` documents)."""
    plan = Plan.load(Path(out))
    lines, check, used, read = [], [], 0, 0
    for index in indices:
        docs, first = part_documents(plan.parts[index], plan.read_options), 0
        try:
            for chunk in chunks(docs, max_docs=64):
                chunk = chunk[: limit - read] if limit else chunk
                held_out = val_mask(plan.settings["seed"], index, first, len(chunk), plan.settings["val_fraction"])
                first, read = first + len(chunk), read + len(chunk)
                for doc, is_val in zip(chunk, held_out):
                    if is_val and len(check) < num_check:
                        check.append(doc)
                    elif not is_val and used < train_chars:
                        kept = [line for line in doc.split("\n") if line.strip()]
                        lines += kept
                        used += sum(map(len, kept))
                if (used >= train_chars and len(check) >= num_check) or (limit and read >= limit):
                    return lines, check
        finally:
            getattr(docs, "close", lambda: None)()
    return lines, check


def local_runner(num_proc: int) -> Runner:
    return lambda plan: run_local(plan, num_proc)


def next_part(plan: Plan, records: dict[int, dict], running: set[int],
              mine: Callable[[int], bool] = lambda index: True) -> int | None:
    """The first of `mine` parts neither finished nor running that the budget may still need (it does unless the
    finished parts before it meet the budget; parts that others run count as unknown)."""
    docs = tokens = 0
    known = True
    for index in range(len(plan.parts)):
        if known and plan.budget.met(docs, tokens):
            return None
        if index in records:
            docs += records[index]["num_docs"]
            tokens += records[index]["splits"]["train"]["num_tokens"]
        elif index in running or not mine(index):
            known = False
        else:
            return index
    return None


def log_progress(plan: Plan, records: dict[int, dict], index: int) -> None:
    """One line per finished part: parts done, the training tokens the output keeps so far (after the budget's
    cut, not what the workers tokenized past it), and the budget's share when there is one."""
    tokens = kept_train_tokens(plan, records)
    budget = plan.budget.max_tokens
    share = f" ({tokens / budget:.1%} of --max-tokens)" if budget else ""
    log.info("part %d done (%d of %d parts finished): %s training tokens kept%s", index, len(records),
             len(plan.parts), f"{tokens:,}", share)


def run_local(plan: Plan, num_proc: int, mine: Callable[[int], bool] = lambda index: True) -> list[float]:
    """The plan's missing `mine` parts on `num_proc` worker processes (in this process for 1), in source order;
    stops as soon as the finished parts meet the budget (workers still running past it are terminated). Records
    are read again before each choice: other SLURM tasks finish parts too."""
    rss, out = [], str(plan.out)
    if num_proc == 1:
        while (index := next_part(plan, records := plan.records(), set(), mine)) is not None:
            records[index], peak = run_part(out, index)
            rss.append(peak)
            log_progress(plan, records, index)
        return rss
    done: queue.Queue = queue.Queue()
    with worker_pool(num_proc) as pool:
        running: set[int] = set()
        while True:
            records = plan.records()
            while len(running) < num_proc and (index := next_part(plan, records, running, mine)) is not None:
                running.add(index)
                pool.apply_async(run_part, (out, index), callback=lambda r, i=index: done.put((i, r, None)),
                                 error_callback=lambda e, i=index: done.put((i, None, e)))
            if not running:
                return rss
            index, result, error = done.get()
            running.discard(index)
            if error is not None:
                raise error
            records[index] = result[0]
            rss.append(result[1])
            log_progress(plan, records, index)
            if plan.usage(records)[1] is None and next_part(plan, records, running, mine) is None:
                return rss   # leaving the pool terminates workers on parts past the budget


def parse_args(argv: list[str] | None = None) -> tuple[PrepConfig, argparse.Namespace]:
    from data_prep import slurm
    parser = argparse.ArgumentParser(prog="python -m data_prep.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="stdlib-docs | hf:NAME[:CONFIG] | files:GLOB")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--vocab-size", type=int, help=f"trained tokenizer size (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=PrepConfig.tokenizer_type)
    parser.add_argument("--tokenizer", help="SentencePiece .model, a directory holding tokenizer.model or "
                                            "tokenizer.json, or a Hugging Face hub name (from the local cache)")
    parser.add_argument("--mode", choices=MODES, default=PrepConfig.mode)
    parser.add_argument("--seq-len", type=int, default=PrepConfig.seq_len)
    parser.add_argument("--val-fraction", type=float, default=PrepConfig.val_fraction)
    parser.add_argument("--num-proc", type=int, default=PrepConfig.num_proc,
                        help="worker processes (per SLURM task with --executor slurm)")
    parser.add_argument("--max-docs", type=int, help="use only the first N documents of the source")
    parser.add_argument("--max-tokens", type=int, help="stop after N training tokens (the document reaching N "
                                                       "is kept whole)")
    parser.add_argument("--seed", type=int, default=PrepConfig.seed)
    parser.add_argument("--tokenizer-train-chars", type=int, default=PrepConfig.tokenizer_train_chars,
                        help="characters of train text the tokenizer is trained on (bounds training time)")
    parser.add_argument("--encoding", default=PrepConfig.encoding, help="codec of files: sources (default utf-8)")
    parser.add_argument("--errors", choices=ERRORS, default=PrepConfig.errors,
                        help="undecodable bytes in files: sources: strict (refuse, naming the file and offset), "
                             "replace (U+FFFD), ignore (drop); a file mostly undecodable is refused as not text")
    parser.add_argument("--text-key", default=PrepConfig.text_key, help="JSON/parquet/HF field of the text")
    parser.add_argument("--format", choices=FORMATS, default=PrepConfig.format,
                        help="kind of files: sources (auto: by name, e.g. .json.gz is JSON lines)")
    parser.add_argument("--part-bytes", type=int, default=PrepConfig.part_bytes,
                        help="uncompressed JSON lines and parquet files are cut into parts of about this size")
    parser.add_argument("--overwrite", action="store_true", help="start over in an --out holding another preparation")
    parser.add_argument("--report", type=Path, help="write this invocation's timings and peak memory as JSON")
    parser.add_argument("--executor", choices=EXECUTORS, default="local",
                        help="local: a pool of --num-proc workers here; slurm: a submitit array of --tasks jobs; "
                             "submitit-local: the same array through submitit's local executor")
    slurm.add_arguments(parser)
    args = parser.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(PrepConfig)}
    cfg = PrepConfig(**{k: v for k, v in vars(args).items() if k in fields})
    return cfg, args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg, args = parse_args(argv)
    runner = None
    if args.executor != "local":
        from data_prep import slurm
        runner = slurm.array_runner(args, cfg.num_proc)
    return prepare(cfg, runner)


def cli(argv: list[str] | None = None) -> int:
    """The command line (`python -m data_prep.prepare`, console script `distsparse-prepare`): exit status 0, or 2
    on bad input with one line naming the file or option and no traceback."""
    try:
        main(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
