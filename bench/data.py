"""Data preparation (issue 30): memory per worker against corpus size, pipeline speed against the tokenizer, parallel
speed-up. The text (default: the Python 3.11 manual, 5,310 info nodes, 19 MB) is written as JSON lines and a
SentencePiece BPE tokenizer (vocab 4096) trained once; every timed preparation is a fresh
`python -m data_prep.prepare` process, whose own `--report` gives its timings and peak RSS (measure inside, report
outside). The figures and the 20B-token extrapolation: docs/benchmarks.md. Run it through /work/quiet.sh for
reported figures.

    python -m bench.data [--quick] [text=/usr/share/info/python3.11.info.gz] [--json PATH]
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.core import Figure, Settings, finish, parse
from data_prep.parts import chunks
from data_prep.readers import text_documents
from data_prep.tokenizer import load_encoder

ROOT = Path(__file__).resolve().parents[1]
TARGET_TOKENS = 20e9
CORES = (16, 64)
TARGETS = {"peak_rss_8x_over_1x": (1.2, "<="), "pipeline_over_encode_only": (0.8, ">="),
           "workers_2_over_1": (1.6, ">=")}


@dataclass
class DataSettings(Settings):
    text: str = "/usr/share/info/python3.11.info.gz"   # a text file (info nodes or paragraphs become documents)
    documents: int = 0          # the first N documents only (0: all)
    vocab_size: int = 4096
    repeats: int = 1            # 1- and 2-worker runs, alternating; the median ratio
    work: str = ""              # working folder (default: a temporary one)
    QUICK = {"documents": 300}

    def __post_init__(self) -> None:
        self.at_least(documents=0, vocab_size=1, repeats=1)


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
    s, json_path = parse(DataSettings, argv, __doc__.split("\n")[0])
    docs = list(text_documents(s.text))[:s.documents or None]
    with tempfile.TemporaryDirectory(dir=s.work or None) as tmp:
        work = Path(tmp)
        (work / "multi").mkdir()
        write_jsonl(work / "x1.jsonl.gz", docs)
        write_jsonl(work / "x8.jsonl.gz", docs, copies=8)
        for i in range(8):
            write_jsonl(work / "multi" / f"part-{i}.jsonl.gz", docs)
        tok = run_prepare(f"files:{work / 'x1.jsonl.gz'}", work / "tok", None, 2, "--vocab-size", str(s.vocab_size))
        tokenizer = work / "tok" / "tokenizer"
        runs = {"text 1x, 1 part": run_prepare(f"files:{work / 'x1.jsonl.gz'}", work / "r1", tokenizer, 2),
                "text 8x, 1 part": run_prepare(f"files:{work / 'x8.jsonl.gz'}", work / "r8", tokenizer, 2)}
        ratios = []
        for repeat in range(s.repeats):
            for workers in ((1, 2) if repeat % 2 == 0 else (2, 1)):
                runs[f"8 parts, {workers} worker(s) #{repeat}"] = run_prepare(
                    f"files:{work / 'multi'}/*.jsonl.gz", work / f"w{workers}_{repeat}", tokenizer, workers)
            one, two = runs[f"8 parts, 1 worker(s) #{repeat}"], runs[f"8 parts, 2 worker(s) #{repeat}"]
            ratios.append(two["streaming_tokens_per_s"] / one["streaming_tokens_per_s"])
        encode_rate = encode_only_tokens_per_s(tokenizer, docs)
    one = runs["8 parts, 1 worker(s) #0"]
    rss_1x, rss_8x = (runs[k]["peak_rss_mb"]["worker_max"] for k in ("text 1x, 1 part", "text 8x, 1 part"))
    values = {"peak_rss_8x_over_1x": rss_8x / rss_1x,
              "pipeline_over_encode_only": one["streaming_tokens_per_s"] / encode_rate,
              "workers_2_over_1": statistics.median(ratios),
              "end_to_end_over_encode_only": one["tokens_per_s"] / encode_rate}
    figures = [Figure(k, v, *TARGETS.get(k, (None,))) for k, v in values.items()]
    ext = extrapolate(one["streaming_tokens_per_s"], values["workers_2_over_1"] / 2,
                      one["seconds"]["finalize"] / one["tokens"],
                      max(r["peak_rss_mb"]["worker_max"] for r in runs.values()),
                      max(r["peak_rss_mb"]["main"] for r in runs.values()))
    rest = {"encode_only_tokens_per_s": encode_rate, "extrapolation": ext, "runs": runs,
            "tokenizer_training": tok["seconds"]}
    config = {"text": s.text, "documents": len(docs), "characters": sum(map(len, docs)), "vocab_size": s.vocab_size,
              "tokenizer": "sentencepiece bpe", "quick": s.quick, "repeats": s.repeats, "omp_num_threads": 1}
    rows = [[name, r["num_proc"], r["tokens"], r["seconds"]["parts"], r["seconds"]["finalize"],
             r["streaming_tokens_per_s"] / 1e6, r["peak_rss_mb"]["worker_max"], r["peak_rss_mb"]["main"],
             f"{r['load_before'][0]:.2f}/{r['load_after'][0]:.2f}"] for name, r in runs.items()]
    per_core = ext["per_core"]
    extra = [["encode only, Mtok/s", encode_rate / 1e6],
             *[[f"20B tokens on {c} cores: hours", per_core[f"{c}_cores"]["hours"]] for c in CORES],
             *[[f"20B tokens on {c} cores: peak RSS GB", per_core[f"{c}_cores"]["peak_rss_gb"]] for c in CORES]]
    return finish(json_path, figures, rest, config,
                  [(["run", "num_proc", "tokens", "parts_s", "finalize_s", "Mtok/s", "worker_MB", "main_MB",
                     "load1 before/after"], rows), (["extrapolation", "value"], extra)],
                  machine={"loadavg_at_end": os.getloadavg()})


if __name__ == "__main__":
    main()
