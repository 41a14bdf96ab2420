"""Data preparation: memory per worker against corpus size, pipeline speed against the tokenizer, parallel speed-up.

    python tools/bench_data.py [--quick] [--text /usr/share/info/python3.11.info.gz] [--json PATH]

The text (default: the Python 3.11 manual, 5,310 info nodes, 19 MB) is written as JSON lines, and a SentencePiece
BPE tokenizer (vocab 4096, as the quick start's) is trained once; every timed preparation is a fresh
`python -m data_prep.prepare` process given that tokenizer, and reads its timings and peak RSS from the
preparation's own `--report` (measure inside, report outside). Figures (issue 30):
- `peak_rss_8x_over_1x`: peak RSS of the worker that prepares a one-part source holding the text 8 times, over
  the same for the text once (`--num-proc 2`, so the worker is a pool process and not the launching one, which
  also loads transformers for the tokenizer check).
- `pipeline_over_encode_only`: training+validation tokens per second of the streaming stages (parts: read,
  split, hold out, encode, write, hash; finalize: verify every shard, count, PPL) on one worker, over the
  tokenizer's own encoding speed on the same documents held in memory, measured in this process in the same
  run. The fixed start-up of a preparation (planning, installing and checking the tokenizer: a few seconds
  whatever the corpus) is reported separately as `end_to_end_over_encode_only`.
- `workers_2_over_1`: the streaming stages' speed with 2 workers over 1, on 8 parts (8 files of the text).
`extrapolation` scales the one-worker rate and the measured 2-worker efficiency to 20B tokens on 16 and 64 cores
(one worker per core; the final check runs in one process). Run it through /work/quiet.sh for reported figures.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import add_json_arg, machine_info, print_table, write_json  # noqa: E402
from data_prep.parts import chunks  # noqa: E402
from data_prep.readers import text_documents  # noqa: E402
from data_prep.tokenizer import load_encoder  # noqa: E402

TARGET_TOKENS = 20e9
CORES = (16, 64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", default="/usr/share/info/python3.11.info.gz", help="a text file (info nodes or "
                   "paragraphs become documents)")
    p.add_argument("--quick", action="store_true", help="the first 300 documents only (tests)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=1, help="1- and 2-worker runs, alternating; the median ratio")
    p.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    add_json_arg(p)
    return p.parse_args(argv)


def write_jsonl(path: Path, docs: list[str], copies: int = 1) -> None:
    with gzip.open(path, "wt", compresslevel=1) as f:
        for _ in range(copies):
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)


def run_prepare(source: str, out: Path, tokenizer: Path | None, num_proc: int, *extra: str) -> dict:
    """One preparation in a fresh process; its --report plus the load averages around it."""
    report = out.with_suffix(".report.json")
    given = ["--tokenizer", str(tokenizer)] if tokenizer else []
    load_before = os.getloadavg()
    subprocess.run([sys.executable, "-m", "data_prep.prepare", "--source", source, "--out", str(out), *given,
                    "--num-proc", str(num_proc), "--report", str(report), *extra], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(report.read_text())
    result["load_before"], result["load_after"] = load_before, os.getloadavg()
    result["tokens"] = sum(result["num_tokens"].values())
    result["streaming_s"] = result["seconds"]["parts"] + result["seconds"]["finalize"]
    result["streaming_tokens_per_s"] = result["tokens"] / result["streaming_s"]
    return result


def encode_only_tokens_per_s(tokenizer: Path, docs: list[str], repeats: int = 3) -> float:
    """The tokenizer's own speed on documents in memory, one thread, in the chunks a worker uses; EOS counted as
    the shards count it (one per document)."""
    encode = load_encoder(str(tokenizer), "sentencepiece")
    rates = []
    for _ in range(repeats):
        t0, tokens = time.perf_counter(), 0
        for chunk in chunks(docs):
            tokens += sum(len(ids) + 1 for ids in encode(chunk))
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def extrapolate(one_worker_rate: float, efficiency: float, finalize_s_per_token: float, worker_mb: float,
                main_mb: float) -> dict:
    rows = {}
    for cores in CORES:
        rate = one_worker_rate * cores * efficiency
        hours = TARGET_TOKENS / rate / 3600 + TARGET_TOKENS * finalize_s_per_token / 3600
        rows[f"{cores}_cores"] = {"workers": cores, "tokens_per_s": rate, "hours": hours,
                                  "peak_rss_gb": (cores * worker_mb + main_mb) / 1024}
    return {"tokens": TARGET_TOKENS, "per_core": rows, "shard_disk_gb_uint16": TARGET_TOKENS * 2 / 1e9,
            "assumes": "one worker per core at the measured one-worker rate times the measured 2-worker efficiency; "
                       "enough parts (files or 128 MiB ranges) to keep every worker busy; the final check "
                       "(sha256, counts, PPL) in one process at its measured rate"}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    docs = list(text_documents(args.text))
    if args.quick:
        docs = docs[:300]
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        (work / "multi").mkdir()
        write_jsonl(work / "x1.jsonl.gz", docs)
        write_jsonl(work / "x8.jsonl.gz", docs, copies=8)
        for i in range(8):
            write_jsonl(work / "multi" / f"part-{i}.jsonl.gz", docs)
        tok = run_prepare(f"files:{work / 'x1.jsonl.gz'}", work / "tok", None, 2, "--vocab-size",
                          str(args.vocab_size))
        tokenizer = work / "tok" / "tokenizer"
        runs = {"text 1x, 1 part": run_prepare(f"files:{work / 'x1.jsonl.gz'}", work / "r1", tokenizer, 2),
                "text 8x, 1 part": run_prepare(f"files:{work / 'x8.jsonl.gz'}", work / "r8", tokenizer, 2)}
        ratios = []
        for repeat in range(args.repeats):
            order = (1, 2) if repeat % 2 == 0 else (2, 1)
            for workers in order:
                runs[f"8 parts, {workers} worker(s) #{repeat}"] = run_prepare(
                    f"files:{work / 'multi'}/*.jsonl.gz", work / f"w{workers}_{repeat}", tokenizer, workers)
            one, two = runs[f"8 parts, 1 worker(s) #{repeat}"], runs[f"8 parts, 2 worker(s) #{repeat}"]
            ratios.append(two["streaming_tokens_per_s"] / one["streaming_tokens_per_s"])
        encode_rate = encode_only_tokens_per_s(tokenizer, docs)
    one = runs["8 parts, 1 worker(s) #0"]
    rss_1x, rss_8x = (runs[k]["peak_rss_mb"]["worker_max"] for k in ("text 1x, 1 part", "text 8x, 1 part"))
    workers_2_over_1 = statistics.median(ratios)
    result = {
        "peak_rss_8x_over_1x": rss_8x / rss_1x,
        "pipeline_over_encode_only": one["streaming_tokens_per_s"] / encode_rate,
        "workers_2_over_1": workers_2_over_1,
        "end_to_end_over_encode_only": one["tokens_per_s"] / encode_rate,
        "encode_only_tokens_per_s": encode_rate,
        "extrapolation": extrapolate(one["streaming_tokens_per_s"], workers_2_over_1 / 2,
                                     one["seconds"]["finalize"] / one["tokens"],
                                     max(r["peak_rss_mb"]["worker_max"] for r in runs.values()),
                                     max(r["peak_rss_mb"]["main"] for r in runs.values())),
        "runs": runs,
        "tokenizer_training": tok["seconds"],
        "machine": {**machine_info(), "loadavg_at_end": os.getloadavg()},
        "config": {"text": args.text, "documents": len(docs), "characters": sum(map(len, docs)),
                   "vocab_size": args.vocab_size, "tokenizer": "sentencepiece bpe", "quick": args.quick,
                   "repeats": args.repeats, "omp_num_threads": 1},
    }
    rows = [[name, r["num_proc"], r["tokens"], r["seconds"]["parts"], r["seconds"]["finalize"],
             r["streaming_tokens_per_s"] / 1e6, r["peak_rss_mb"]["worker_max"], r["peak_rss_mb"]["main"],
             f"{r['load_before'][0]:.2f}/{r['load_after'][0]:.2f}"] for name, r in runs.items()]
    print_table(["run", "num_proc", "tokens", "parts_s", "finalize_s", "Mtok/s", "worker_MB", "main_MB",
                 "load1 before/after"], rows)
    print()
    ext = result["extrapolation"]["per_core"]
    print_table(["figure", "value"], [
        ["peak_rss_8x_over_1x (<= 1.2)", result["peak_rss_8x_over_1x"]],
        ["pipeline_over_encode_only (>= 0.8)", result["pipeline_over_encode_only"]],
        ["workers_2_over_1 (>= 1.6)", result["workers_2_over_1"]],
        ["end_to_end_over_encode_only", result["end_to_end_over_encode_only"]],
        ["encode only, Mtok/s", encode_rate / 1e6],
        *[[f"20B tokens on {c} cores: hours", ext[f"{c}_cores"]["hours"]] for c in CORES],
        *[[f"20B tokens on {c} cores: peak RSS GB", ext[f"{c}_cores"]["peak_rss_gb"]] for c in CORES],
    ])
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
