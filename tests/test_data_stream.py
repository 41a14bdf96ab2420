"""Streaming preparation (issue 30): kill -9 and the same command give the files of an uninterrupted run; the
output does not depend on workers, executors or chunking; C4's `.json.gz` files are JSON lines; budgets stop
within one document; formats; the Megatron index; a preparation of other settings is refused."""

import gzip
import json
import logging
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from data_prep.parts import chunks, val_mask
from data_prep.prepare import PrepConfig, main, prepare
from data_prep.readers import ReadOptions, read_file_documents
from data_prep.sources import iter_documents, parse_source
from distsparse.data import TokenDataset
from distsparse.data.shards import read_index

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("sparse model layer weight gradient token corpus shard worker budget tokenizer document value group "
         "mask topology refresh owner rank step").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A SentencePiece tokenizer prepared once (a given tokenizer keeps the tests off tokenizer training)."""
    root = tmp_path_factory.mktemp("tok")
    rng = random.Random(0)
    (root / "seed.txt").write_text("\n\n".join(_text(rng, 30) for _ in range(300)))
    main(["--source", f"files:{root / 'seed.txt'}", "--out", str(root / "data"), "--vocab-size", "300",
          "--num-proc", "1"])
    return str(root / "data" / "tokenizer")


def _jsonl_files(folder: Path, num_files: int, docs_per_file: int, seed: int = 1, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for f in range(num_files):
        docs = [_text(rng, rng.randint(words // 2, words)) for _ in range(docs_per_file)]
        with gzip.open(folder / f"part-{f:03d}.jsonl.gz", "wt") as out:
            out.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
        texts += docs
    return texts


def _decoded(data_dir: Path) -> list[str]:
    """Every document of both splits, read back with numpy and sentencepiece, in shard order."""
    meta = json.loads((data_dir / "meta.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "tokenizer" / "tokenizer.model"))
    docs = []
    for split in ("train", "val"):
        for entry in meta["shards"][split]:
            tokens = np.fromfile(data_dir / entry["file"], dtype=meta["dtype"]).tolist()
            cuts = [i for i, t in enumerate(tokens) if t == meta["eos_id"]]
            docs += [sp.decode(tokens[a + 1: b]) for a, b in zip([-1] + cuts[:-1], cuts)]
    return docs


def _files(data_dir: Path) -> dict[str, bytes]:
    """meta.json and every shard file, by name."""
    found = {"meta.json": (data_dir / "meta.json").read_bytes()}
    found.update({f"shards/{p.name}": p.read_bytes() for p in sorted((data_dir / "shards").iterdir())})
    return found


def _command(source: str, out: Path, tokenizer: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "data_prep.prepare", "--source", source, "--out", str(out), "--tokenizer",
            tokenizer, "--seq-len", "32", "--val-fraction", "0.1", *extra]


def _whole_then_start(tmp_path, tokenizer, num_files: int, docs_per_file: int):
    """(source, whole, cut, proc): an uninterrupted 1-worker preparation in `whole`, then the same with 2 workers
    started into `cut` in its own session (the caller interrupts it)."""
    _jsonl_files(tmp_path / "src", num_files=num_files, docs_per_file=docs_per_file)
    source = f"files:{tmp_path / 'src'}/*.jsonl.gz"
    whole = tmp_path / "whole"
    subprocess.run(_command(source, whole, tokenizer, "--num-proc", "1"), check=True, cwd=ROOT)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(_command(source, cut, tokenizer, "--num-proc", "2"), cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return source, whole, cut, proc


def test_kill_9_in_the_middle_then_the_same_command_gives_the_files_of_an_uninterrupted_run(tmp_path, tokenizer):
    source, whole, cut, proc = _whole_then_start(tmp_path, tokenizer, 8, 1500)
    deadline = time.monotonic() + 300
    while not len(list((cut / "parts").glob("*.json"))) >= 2 and proc.poll() is None:
        assert time.monotonic() < deadline, "no part finished in 300 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)   # the launcher and its workers, mid-part
    proc.wait()
    finished = len(list((cut / "parts").glob("*.json")))
    assert not (cut / "meta.json").exists() and 2 <= finished < 8, finished
    subprocess.run(_command(source, cut, tokenizer, "--num-proc", "2"), check=True, cwd=ROOT)
    assert _files(cut) == _files(whole)
    meta = json.loads((whole / "meta.json").read_text())
    assert meta["num_parts"] == 8 and len(meta["shards"]["train"]) == 8


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_kill_9_of_the_launcher_alone_ends_its_workers_and_the_same_command_resumes(tmp_path, tokenizer):
    """Workers orphaned by a kill of the launcher pid only (not its group) would go on writing `.partial` shards
    that a restarted preparation writes too: they must follow their launcher within seconds. Parts take several
    seconds each, so a worker that only notices on its next task (multiprocessing's own EOF on the task pipe)
    would still be writing when the deadline passes."""
    source, whole, cut, proc = _whole_then_start(tmp_path, tokenizer, 4, 50000)
    try:
        deadline = time.monotonic() + 300
        # A part of the second wave (2 or 3; 0 and 1 went first) under way: a worker is at the start of a part,
        # writing its `.partial` shards.
        while not list((cut / "shards").glob("train-0000[23].bin.partial")) and proc.poll() is None:
            assert time.monotonic() < deadline, "no part finished and another started in 300 s"
            time.sleep(0.01)
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers   # the pool's two workers (and spawn's resource tracker)
        os.kill(proc.pid, signal.SIGKILL)   # the launcher only
        proc.wait()
        killed = time.monotonic()
        while any(map(_alive, workers)) and time.monotonic() < killed + 1:
            time.sleep(0.02)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived their launcher by 1 s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # whatever survived, so the test leaks nothing
        except ProcessLookupError:
            pass
    assert not (cut / "meta.json").exists() and 1 <= len(list((cut / "parts").glob("*.json"))) < 4
    subprocess.run(_command(source, cut, tokenizer, "--num-proc", "2"), check=True, cwd=ROOT)
    assert _files(cut) == _files(whole)


def test_c4_named_json_gz_files_yield_their_records_as_documents(tmp_path, tokenizer):
    rng = random.Random(2)
    records = [{"text": _text(rng, rng.randint(5, 40)) + "\n" + _text(rng, 8), "timestamp": "2019-04-25T12:57:54Z",
                "url": f"https://example.com/{i}"} for i in range(120)]
    c4 = tmp_path / "c4" / "c4-train.00000-of-01024.json.gz"
    c4.parent.mkdir()
    with gzip.open(c4, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert read_file_documents(str(c4)) == [r["text"] for r in records]
    out = tmp_path / "out"
    meta = prepare(PrepConfig(source=f"files:{c4}", out=out, tokenizer=tokenizer, seq_len=16, num_proc=1))
    assert meta["num_docs"]["train"] + meta["num_docs"]["val"] == len(records)
    assert sorted(_decoded(out)) == sorted(r["text"] for r in records)


def test_json_lines_named_as_text_are_refused_naming_the_file_and_the_flag(tmp_path, tokenizer):
    misnamed = tmp_path / "records.txt.gz"
    with gzip.open(misnamed, "wt") as f:
        f.writelines(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20))
    with pytest.raises(ValueError, match=rf"{misnamed}: named as text, but its first line is a JSON object.*"
                                         r"--format jsonl"):
        prepare(PrepConfig(source=f"files:{misnamed}", out=tmp_path / "a", tokenizer=tokenizer, num_proc=1))
    meta = prepare(PrepConfig(source=f"files:{misnamed}", out=tmp_path / "b", tokenizer=tokenizer, num_proc=1,
                              seq_len=4, val_fraction=0.3, format="jsonl"))
    assert sorted(_decoded(tmp_path / "b")) == sorted(f"document {i}" for i in range(20))
    assert meta["num_docs"]["train"] + meta["num_docs"]["val"] == 20


def test_max_tokens_stops_within_one_document_of_n_reading_only_a_prefix(tmp_path, tokenizer):
    texts = _jsonl_files(tmp_path / "src", num_files=6, docs_per_file=400)
    for n in (2_000, 23_456):
        out = tmp_path / f"n{n}"
        report = tmp_path / f"n{n}.json"
        meta = prepare(PrepConfig(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=out, tokenizer=tokenizer,
                                  seq_len=16, val_fraction=0.1, max_tokens=n, num_proc=1, report=report))
        train = meta["shards"]["train"]
        last = read_index((out / train[-1]["file"]).with_suffix(".idx"))[1]
        assert n <= meta["num_tokens"]["train"] < n + int(last[-1])   # the document that reached N is the last
        kept = meta["num_docs"]["train"] + meta["num_docs"]["val"]
        assert sorted(_decoded(out)) == sorted(texts[:kept])           # a prefix of the source, both splits
        assert json.loads(report.read_text())["parts_run"] == meta["num_parts"] < 6
    docs = prepare(PrepConfig(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=tmp_path / "docs",
                              tokenizer=tokenizer, seq_len=16, max_docs=555, num_proc=2))
    assert docs["num_docs"]["train"] + docs["num_docs"]["val"] == 555 and docs["num_parts"] == 2


def _progress_tokens(caplog) -> list[int]:
    return [int(m.group(1).replace(",", "")) for r in caplog.records
            if (m := re.search(r"parts finished\): ([\d,]+) training tokens kept", r.getMessage()))]


@pytest.mark.parametrize("budget, num_proc", [({"max_tokens": 9_000}, 1), ({"max_tokens": 9_000}, 2),
                                              ({"max_docs": 555}, 2), ({}, 2)], ids=str)
def test_the_progress_line_counts_the_training_tokens_the_output_keeps(tmp_path, tokenizer, caplog, budget,
                                                                      num_proc):
    """Not the tokens the workers wrote past the budget: a part stops a chunk after it, parts already running
    finish, and finalize cuts them away; the last line gives meta.json's training tokens."""
    _jsonl_files(tmp_path / "src", num_files=6, docs_per_file=400)
    report = tmp_path / "report.json"
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        meta = prepare(PrepConfig(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=tmp_path / "out",
                                  tokenizer=tokenizer, seq_len=16, val_fraction=0.1, num_proc=num_proc,
                                  report=report, **budget))
    lines = _progress_tokens(caplog)
    assert len(lines) == json.loads(report.read_text())["parts_run"]   # one line per finished part
    assert lines and lines[-1] == meta["num_tokens"]["train"]
    assert lines == sorted(lines)   # tokens kept only grow
    if "max_tokens" in budget:
        last_share = float(re.findall(r"\(([\d.]+)% of --max-tokens\)", caplog.text)[-1])
        assert last_share == pytest.approx(100 * meta["num_tokens"]["train"] / budget["max_tokens"], abs=0.06)
        assert last_share >= 100


def test_max_tokens_streams_an_hf_dataset_folder_reading_within_one_chunk_of_n(tmp_path, tokenizer, monkeypatch):
    import datasets
    from data_prep.parts import CHUNK_DOCS
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "hub_like"
    folder.mkdir()
    rng = random.Random(3)
    for f in range(4):
        (folder / f"train-{f}.jsonl").write_text("".join(json.dumps({"content": _text(rng, 30)}) + "\n"
                                                         for _ in range(4000 if f == 0 else 200)))
    report = tmp_path / "report.json"
    meta = prepare(PrepConfig(source=f"hf:{folder}", out=tmp_path / "out", tokenizer=tokenizer, seq_len=16,
                              max_tokens=30_000, val_fraction=0.2, text_key="content", num_proc=1, report=report))
    assert meta["num_tokens"]["train"] >= 30_000 and meta["num_parts"] == 1
    assert json.loads(report.read_text())["parts_run"] == 1   # shards 2..4 of the stream were never opened
    record = json.loads((tmp_path / "out" / "parts" / "00000.json").read_text())
    kept = meta["num_docs"]["train"] + meta["num_docs"]["val"]
    assert record["num_docs"] == kept and kept < record["cut_from"] <= kept + CHUNK_DOCS < 4000   # read: one chunk more


def test_the_output_depends_neither_on_workers_nor_on_executor_nor_on_chunking(tmp_path, tokenizer, monkeypatch):
    _jsonl_files(tmp_path / "src", num_files=3, docs_per_file=300)
    source = f"files:{tmp_path / 'src'}/*.jsonl.gz"
    one = tmp_path / "one"
    prepare(PrepConfig(source=source, out=one, tokenizer=tokenizer, seq_len=16, max_docs=700, num_proc=1))
    meta = main(["--source", source, "--out", str(tmp_path / "array"), "--tokenizer", tokenizer, "--seq-len", "16",
               "--max-docs", "700", "--executor", "submitit-local", "--tasks", "2", "--num-proc", "1",
               "--time", "10"])
    assert meta["num_parts"] == 3 and _files(tmp_path / "array") == _files(one)
    import data_prep.parts as parts
    monkeypatch.setattr(parts, "CHUNK_DOCS", 7)   # chunks of 7 documents instead of 1024
    prepare(PrepConfig(source=source, out=tmp_path / "small_chunks", tokenizer=tokenizer, seq_len=16,
                       max_docs=700, num_proc=1))
    assert _files(tmp_path / "small_chunks") == _files(one)


def test_validation_documents_are_held_out_by_document_index_whatever_the_chunking():
    whole = val_mask(5, 3, 0, 100_000, 0.02)
    pieces = np.concatenate([val_mask(5, 3, a, 1000, 0.02) for a in range(0, 100_000, 1000)])
    assert np.array_equal(whole, pieces)
    assert abs(whole.mean() - 0.02) < 4 * np.sqrt(0.02 * 0.98 / whole.size)
    assert not np.array_equal(whole, val_mask(5, 4, 0, 100_000, 0.02))   # another part, another draw
    assert not np.array_equal(whole, val_mask(6, 3, 0, 100_000, 0.02))   # another seed
    assert [len(c) for c in chunks(["ab"] * 10, max_docs=4)] == [4, 4, 2]
    assert [len(c) for c in chunks(["abc"] * 5, max_docs=100, max_chars=6)] == [2, 2, 1]


def test_other_formats_byte_ranges_and_row_groups_give_every_record_once(tmp_path, tokenizer):
    import zstandard
    rng = random.Random(4)
    texts = [_text(rng, rng.randint(10, 60)) for _ in range(900)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[:300]))
    with open(src / "b.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress("".join(json.dumps({"body": t}) + "\n"
                                                            for t in texts[300:600]).encode()))
    pq.write_table(pa.table({"body": texts[600:]}), src / "c.parquet", row_group_size=20)
    opts = ReadOptions(text_key="body")
    assert list(iter_documents(parse_source(f"files:{src}/*"), opts, part_bytes=1 << 16)) == texts
    # 64 KiB parts: a.jsonl (about 80 KiB) is read in two byte ranges, c.parquet in two runs of row groups
    out = tmp_path / "out"
    meta = prepare(PrepConfig(source=f"files:{src}/*", out=out, tokenizer=tokenizer, seq_len=16, text_key="body",
                              part_bytes=1 << 16, num_proc=2))
    assert meta["num_parts"] == 5, meta["num_parts"]
    assert sorted(_decoded(out)) == sorted(texts)


def test_shard_indexes_are_megatron_mmidx_files_and_the_dataset_reads_across_shards(tmp_path, tokenizer):
    _jsonl_files(tmp_path / "src", num_files=3, docs_per_file=50)
    out = tmp_path / "out"
    meta = prepare(PrepConfig(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=out, tokenizer=tokenizer,
                              seq_len=16, num_proc=1))
    stream = []
    for entry in meta["shards"]["train"]:
        tokens = np.fromfile(out / entry["file"], dtype=np.uint16)
        stream.append(tokens)
        # megatron/core/datasets/indexed_dataset.py _IndexReader, field by field
        raw = (out / entry["file"]).with_suffix(".idx").read_bytes()
        assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<Q", raw[9:17])[0] == 1 and raw[17] == 8  # uint16
        sequences, documents = struct.unpack("<QQ", raw[18:34])
        lengths = np.frombuffer(raw, np.int32, sequences, 34)
        pointers = np.frombuffer(raw, np.int64, sequences, 34 + 4 * sequences)
        doc_index = np.frombuffer(raw, np.int64, documents, 34 + 12 * sequences)
        assert sequences == entry["num_docs"] and documents == sequences + 1 and lengths.sum() == tokens.size
        assert np.array_equal(pointers, 2 * np.r_[0, np.cumsum(lengths)[:-1]])
        assert np.array_equal(doc_index, np.arange(sequences + 1))
        assert np.array_equal(np.flatnonzero(tokens == meta["eos_id"]) + 1, np.cumsum(lengths))   # EOS ends each
    stream = np.concatenate(stream)
    ds = TokenDataset(out, "train", 16)
    assert len(ds) == stream.size // 16 and len(meta["shards"]["train"]) == 3
    for i in range(len(ds)):   # every sample, including those that span two shards
        assert ds[i]["input_ids"].tolist() == stream[16 * i: 16 * (i + 1)].tolist()


def test_another_command_into_the_same_directory_is_refused_naming_the_settings(tmp_path, tokenizer):
    _jsonl_files(tmp_path / "src", num_files=1, docs_per_file=50)
    cfg = dict(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=tmp_path / "out", tokenizer=tokenizer, seq_len=16,
               val_fraction=0.2, num_proc=1)
    first = prepare(PrepConfig(**cfg))
    assert prepare(PrepConfig(**{**cfg, "num_proc": 2})) == first   # --num-proc does not change the output
    with pytest.raises(ValueError, match=r"--out: .* holds a preparation with other settings \(seed: 0 there, 1 now\); "
                                         r"allowed: the same command .*--overwrite"):
        prepare(PrepConfig(**cfg, seed=1))
    again = prepare(PrepConfig(**cfg, seed=1, overwrite=True))
    assert again["seed"] == 1 and again["shards"] != first["shards"]


def test_the_slurm_array_tasks_carry_the_cluster_options(tmp_path, fake_srun):
    from data_prep import slurm
    from data_prep.prepare import parse_args
    cfg, args = parse_args(["--source", "stdlib-docs", "--out", str(tmp_path / "out"), "--executor", "slurm",
                            "--tasks", "4", "--num-proc", "16", "--partition", "cpu", "--account", "proj",
                            "--time", "4:00:00", "--mem-gb", "64"])
    text = slurm.make_executor(args, tmp_path / "sub", cfg.num_proc)._make_submission_file_text("CMD", "uid")
    for line in ("--cpus-per-task=16", "--partition=cpu", "--account=proj", "--time=240", "--nodes=1",
                 "--ntasks-per-node=1", "--mem=64GB", "--job-name=data_prep"):
        assert f"#SBATCH {line}\n" in text, (line, text)
    args.tasks = 0
    with pytest.raises(ValueError, match=r"--tasks: got 0; allowed: >= 1"):
        slurm.make_executor(args, tmp_path / "sub", cfg.num_proc)


def test_a_damaged_or_missing_shard_of_a_finished_part_is_found_and_the_part_prepared_again(tmp_path, tokenizer):
    _jsonl_files(tmp_path / "src", num_files=3, docs_per_file=100)
    cfg = dict(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=tmp_path / "out", tokenizer=tokenizer, seq_len=16,
               val_fraction=0.2, num_proc=1)
    prepare(PrepConfig(**cfg))
    reference = _files(tmp_path / "out")
    shard = tmp_path / "out" / "shards" / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF   # same size: only the sha256 shows it
    shard.write_bytes(bytes(data))
    (tmp_path / "out" / "meta.json").unlink()
    with pytest.raises(ValueError, match=rf"{shard}: its sha256 is not the one in .*00001.json.*rerun the same command"):
        prepare(PrepConfig(**cfg))
    prepare(PrepConfig(**cfg))
    assert _files(tmp_path / "out") == reference
    (tmp_path / "out" / "shards" / "val-00002.idx").unlink()   # a file of a finished part gone
    (tmp_path / "out" / "meta.json").unlink()
    prepare(PrepConfig(**cfg))
    assert _files(tmp_path / "out") == reference


def test_a_truncated_shard_of_a_sharded_preparation_is_refused_naming_the_file(tmp_path, tokenizer):
    _jsonl_files(tmp_path / "src", num_files=2, docs_per_file=100)
    out = tmp_path / "out"
    meta = prepare(PrepConfig(source=f"files:{tmp_path / 'src'}/*.jsonl.gz", out=out, tokenizer=tokenizer,
                              seq_len=16, val_fraction=0.2, num_proc=1))
    shard = out / meta["shards"]["train"][1]["file"]
    shard.write_bytes(shard.read_bytes()[:-32])   # 16 whole tokens fewer
    tokens = meta["shards"]["train"][1]["num_tokens"]
    with pytest.raises(ValueError, match=rf"{shard} holds {2 * tokens - 32} bytes; its meta.json says {tokens} "
                                         rf"uint16 tokens"):
        TokenDataset(out, "train", 16)
