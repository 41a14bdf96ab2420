"""data_prep and TokenDataset: tokenizer round trips, shard layout, meta.json, unigram PPL, sources, errors."""

import ast
import collections
import gzip
import hashlib
import io
import itertools
import json
import math
import tokenize

import numpy as np
import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import torch

from data_prep.prepare import PrepConfig, main, prepare
from data_prep.readers import ReadOptions, read_file_documents
from data_prep.sources import MIN_COMMENT_CHARS, _comment_blocks, _docstrings, iter_documents, parse_source, stdlib_files
from distsparse.data import IGNORE_INDEX, TokenDataset, load_meta

MAX_DOCS = 600
SEQ_LEN = 64
HARD_TEXTS = ["  two leading spaces", "trailing newline\n", "\ttab\tand\n\n\nblank lines", "emoji \U0001F600 and "
              "\u00fc\u00f1\u00ee\u00e7\u00f8d\u00e9 \u4e2d\u6587", "   ", "x" * 3000]


@pytest.fixture(scope="module")
def docs():
    return list(itertools.islice(iter_documents(parse_source("stdlib-docs")), MAX_DOCS))


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed")
    main(["--source", "stdlib-docs", "--out", str(out), "--vocab-size", "512", "--max-docs", str(MAX_DOCS),
          "--seq-len", str(SEQ_LEN), "--val-fraction", "0.1", "--num-proc", "2"])
    return out


@pytest.fixture(scope="module")
def truncated(tmp_path_factory, packed):
    out = tmp_path_factory.mktemp("truncated")
    prepare(PrepConfig(source="stdlib-docs", out=out, tokenizer=str(packed / "tokenizer"), mode="truncate_pad",
                       seq_len=SEQ_LEN, max_docs=MAX_DOCS, val_fraction=0.1, num_proc=1))
    return out


def _processor(data_dir):
    return spm.SentencePieceProcessor(model_file=str(data_dir / "tokenizer" / "tokenizer.model"))


def _shard(data_dir, split):
    """A split's shards, read file by file with numpy and concatenated in meta.json's order."""
    meta = json.loads((data_dir / "meta.json").read_text())
    files = [data_dir / entry["file"] for entry in meta["shards"][split]]
    return np.concatenate([np.fromfile(f, dtype=meta["dtype"]) for f in files]).astype(np.int64), meta


def _split_on_eos(tokens, eos_id):
    cuts = np.flatnonzero(tokens == eos_id)
    return [tokens[a + 1: b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def test_decode_of_encode_returns_every_default_corpus_document_and_hard_texts(packed, docs):
    sp = _processor(packed)
    assert len(docs) == MAX_DOCS
    for text in docs + HARD_TEXTS:
        assert sp.decode(sp.encode(text)) == text


def test_autotokenizer_loads_the_saved_tokenizer_and_encodes_like_sentencepiece(packed, docs):
    from transformers import AutoTokenizer

    sp, meta = _processor(packed), load_meta(packed)
    hf = AutoTokenizer.from_pretrained(packed / "tokenizer")
    for text in docs[:150] + HARD_TEXTS:
        ids = sp.encode(text)
        assert hf.encode(text) == ids  # default call adds no BOS/EOS, like the shards' documents
        assert hf.decode(ids) == text
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        meta["bos_id"], meta["eos_id"], meta["pad_id"], meta["unk_id"]) == (1, 2, 3, 0)
    assert len(hf) == meta["vocab_size"] == sp.get_piece_size() == 512
    assert meta["tokenizer_check"]["checked"] > 0
    assert meta["tokenizer_check"] == {"checked": meta["tokenizer_check"]["checked"], "id_mismatch": 0, "lossy": 0}


def test_packed_shards_hold_every_document_once_followed_by_eos_and_meta_counts_them(packed, docs):
    sp = _processor(packed)
    train, meta = _shard(packed, "train")
    val, _ = _shard(packed, "val")
    expected_keys = {"vocab_size", "tokenizer_sha256", "dtype", "mode", "seq_len", "source", "num_docs",
                     "num_tokens", "bos_id", "eos_id", "pad_id", "unigram_val_ppl"}
    assert expected_keys <= meta.keys()
    assert (meta["dtype"], meta["mode"], meta["seq_len"]) == ("uint16", "packed", SEQ_LEN)
    assert meta["source"] == "stdlib-docs"
    model_bytes = (packed / "tokenizer" / "tokenizer.model").read_bytes()
    assert meta["tokenizer_sha256"] == hashlib.sha256(model_bytes).hexdigest()
    assert meta["num_tokens"] == {"train": train.size, "val": val.size}
    assert sum((packed / e["file"]).stat().st_size for e in meta["shards"]["train"]) == 2 * train.size
    assert meta["num_docs"] == {"train": int((train == 2).sum()), "val": int((val == 2).sum())}
    # each document held out with probability 0.1: 60 expected, 7.3 the binomial standard deviation
    assert abs(meta["num_docs"]["val"] - 0.1 * MAX_DOCS) < 4 * math.sqrt(MAX_DOCS * 0.1 * 0.9)
    train_docs = [sp.decode(piece.tolist()) for piece in _split_on_eos(train, meta["eos_id"])]
    val_docs = [sp.decode(piece.tolist()) for piece in _split_on_eos(val, meta["eos_id"])]
    assert sorted(train_docs + val_docs) == sorted(docs)
    duplicated = {text for text, count in collections.Counter(docs).items() if count > 1}
    assert not (set(train_docs) & set(val_docs)) - duplicated  # split by document


def test_packed_dataset_cuts_consecutive_windows_with_labels_equal_to_inputs(packed):
    train, _ = _shard(packed, "train")
    for seq_len in (SEQ_LEN, 17):  # shorter than prepared is allowed for packed data
        ds = TokenDataset(packed, "train", seq_len)
        assert len(ds) == train.size // seq_len
        for i in (0, 5, len(ds) - 1):
            sample = ds[i]
            assert sample["input_ids"].dtype == torch.int64
            assert sample["input_ids"].tolist() == train[i * seq_len: (i + 1) * seq_len].tolist()
            assert torch.equal(sample["labels"], sample["input_ids"])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_truncate_pad_rows_are_document_prefixes_ending_in_eos_then_pad_with_labels_ignored(truncated, docs):
    sp = _processor(truncated)
    rows, meta = _shard(truncated, "val")
    rows = rows.reshape(-1, SEQ_LEN)
    eos, pad = meta["eos_id"], meta["pad_id"]
    prefixes = {tuple(sp.encode(text)[: SEQ_LEN - 1]) for text in docs}
    ds = TokenDataset(truncated, "val", SEQ_LEN)
    assert len(ds) == rows.shape[0] == meta["num_docs"]["val"]
    assert meta["num_tokens"]["val"] == int((rows != pad).sum())
    for i, row in enumerate(rows):
        length = int((row != pad).sum())
        assert (row[length:] == pad).all() and (row[:length] != pad).all()  # pad only at the end
        assert row[length - 1] == eos and tuple(row[: length - 1].tolist()) in prefixes
        sample = ds[i]
        assert sample["input_ids"].tolist() == row.tolist()
        assert sample["labels"][:length].tolist() == row[:length].tolist()
        assert (sample["labels"][length:] == IGNORE_INDEX).all()
    assert (rows[:, -1] != pad).any()  # some documents were long enough to be cut


def test_truncate_pad_dataset_refuses_another_seq_len(truncated):
    with pytest.raises(ValueError, match=rf"seq_len: got 32; allowed: {SEQ_LEN}"):
        TokenDataset(truncated, "train", 32)


@pytest.mark.parametrize("fixture", ["packed", "truncated"])
def test_unigram_val_ppl_equals_an_add_one_smoothed_count_over_the_scored_tokens(fixture, request):
    data_dir = request.getfixturevalue(fixture)
    meta = load_meta(data_dir)
    train, _ = _shard(data_dir, "train")
    counts = collections.Counter(t for t in train.tolist() if meta["mode"] == "packed" or t != meta["pad_id"])
    total, vocab = sum(counts.values()), meta["vocab_size"]
    nll, num = 0.0, 0
    ds = TokenDataset(data_dir, "val", SEQ_LEN)
    for i in range(len(ds)):
        for t in ds[i]["labels"][1:].tolist():  # the model predicts positions 1.. of a sample
            if t != IGNORE_INDEX:
                nll -= math.log((counts[t] + 1) / (total + vocab))
                num += 1
    assert meta["unigram_val_ppl"] == pytest.approx(math.exp(nll / num), rel=1e-9)
    assert 1 < meta["unigram_val_ppl"] < vocab


def _write_files(tmp_path):
    info = "header text\n\x1f\nFile: t.info,  Node: A\n\nFirst node para.\n\nSecond para.\n\x1f\nNode B body\n"
    with gzip.open(tmp_path / "manual.info.gz", "wt") as f:
        f.write(info)
    with gzip.open(tmp_path / "notes.txt.gz", "wt") as f:
        f.write("para one line 1\npara one line 2\n\n\npara two\n  \t\npara three\n")
    (tmp_path / "records.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in
                                                      enumerate(["json doc one", "", "json doc\ntwo"])) + "\n")
    pq.write_table(pa.table({"text": ["parquet row", "  "], "other": [1, 2]}), tmp_path / "table.parquet")
    return {
        "manual.info.gz": ["header text", "File: t.info,  Node: A\n\nFirst node para.\n\nSecond para.",
                           "Node B body"],
        "notes.txt.gz": ["para one line 1\npara one line 2", "para two", "para three"],
        "records.jsonl": ["json doc one", "json doc\ntwo"],
        "table.parquet": ["parquet row"],
    }


def test_files_source_splits_gz_text_on_info_nodes_or_paragraphs_and_reads_jsonl_and_parquet(
        tmp_path, packed):
    src = tmp_path / "src"
    src.mkdir()
    expected = _write_files(src)
    for name, documents in expected.items():
        assert read_file_documents(str(src / name)) == documents
    out = tmp_path / "out"
    meta = prepare(PrepConfig(source=f"files:{src}/*", out=out, tokenizer=str(packed / "tokenizer" / "tokenizer.model"),
                              seq_len=4, val_fraction=0.3, num_proc=1))
    all_docs = sum(expected.values(), [])
    assert meta["num_docs"]["train"] + meta["num_docs"]["val"] == len(all_docs) and meta["num_docs"]["val"] > 0
    sp = _processor(out)
    decoded = [sp.decode(piece.tolist()) for split in ("train", "val")
               for piece in _split_on_eos(_shard(out, split)[0], meta["eos_id"])]
    assert sorted(decoded) == sorted(all_docs)


def test_comment_and_docstring_extraction_agrees_with_tokenize_and_ast_walk(tmp_path):
    files = stdlib_files()[::120]
    for path in files:
        source = path.read_bytes()
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        walked = [(node.body[0].lineno, ast.get_docstring(node)) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and ast.get_docstring(node) and ast.get_docstring(node).strip()]
        assert sorted(_docstrings(tree, [])) == sorted(walked)
        lines = source.decode("utf-8", errors="replace").splitlines()
        full_line = [(tok.start[0], tok.string) for tok in tokenize.tokenize(io.BytesIO(source).readline)
                     if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip()
                     and not tok.string.startswith(("#!", "# -*-"))]
        blocks, last = [], -1
        for line, text in full_line:
            if line != last + 1:
                blocks.append((line, []))
            blocks[-1][1].append(text[2:] if text.startswith("# ") else text[1:])
            last = line
        reference = [(line, "\n".join(b).strip()) for line, b in blocks]
        reference = [(line, text) for line, text in reference if len(text) >= MIN_COMMENT_CHARS]
        assert _comment_blocks(source.decode("utf-8", errors="replace")) == reference, path


def test_bad_inputs_raise_value_errors_naming_the_value_and_what_is_allowed(tmp_path, truncated):
    with pytest.raises(ValueError, match=r"--source: got 's3://bucket'; allowed: stdlib-docs, hf:NAME"):
        parse_source("s3://bucket")
    with pytest.raises(ValueError, match=r"--source: got 'hf:'"):
        PrepConfig(source="hf:", out=tmp_path)
    assert parse_source("hf:allenai/c4:en").config == "en"
    with pytest.raises(ValueError, match=r"--mode: got 'galore'; allowed: packed, truncate_pad"):
        PrepConfig(source="stdlib-docs", out=tmp_path, mode="galore")
    with pytest.raises(ValueError, match="no file matches"):
        list(iter_documents(parse_source(f"files:{tmp_path}/*.txt")))
    (tmp_path / "table.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"table.csv.*unsupported type; allowed: \.jsonl, \.json"):
        list(iter_documents(parse_source(f"files:{tmp_path}/*")))
    with pytest.raises(ValueError, match=r"--tokenizer: got .*nothing.*no such file.*allowed: a SentencePiece .model"):
        PrepConfig(source="stdlib-docs", out=tmp_path / "o", tokenizer=str(tmp_path / "nothing"))
    missing = tmp_path / "no_such_dir"
    with pytest.raises(ValueError, match=rf"data_dir: got '{missing}', which is not a directory"):
        load_meta(missing)
    with pytest.raises(ValueError, match=r"has no meta.json"):
        TokenDataset(tmp_path, "train", SEQ_LEN)
    with pytest.raises(ValueError, match=r"split: got 'test'; allowed: train, val"):
        TokenDataset(truncated, "test", SEQ_LEN)


def test_hf_source_loads_a_local_dataset_folder_streamed_or_whole_and_needs_a_text_column(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "hub_like"
    folder.mkdir()
    texts = [f"document {i}" if i % 4 else "  " for i in range(12)]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    non_blank = [t for t in texts if t.strip()]
    assert list(iter_documents(parse_source(f"hf:{folder}"))) == non_blank
    (folder / "train.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"hf:.*hub_like: the dataset has no 'text' column; columns: \['body'\]"):
        list(iter_documents(parse_source(f"hf:{folder}")))
    assert list(iter_documents(parse_source(f"hf:{folder}"), ReadOptions(text_key="body"))) == ["x"]
