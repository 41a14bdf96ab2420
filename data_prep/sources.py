"""Document sources for data preparation: `stdlib-docs`, `hf:NAME[:CONFIG]` and `files:GLOB`.

Owns turning a `--source` string into a `datasets.Dataset` with one `text` column, one document per row,
in a deterministic order. It does not tokenize or split (prepare.py does). research/pretraining_ecosystem.md s2.

- `stdlib-docs`: the docstrings and full-line comment blocks of the running Python's standard library (the
  `.py` files under `sysconfig`'s stdlib path, `site-packages` excluded), present on every machine, no network.
  Files are read in sorted path order and each file's documents in line order, so the corpus is a pure function
  of the Python version. Docstrings come from `ast`; comments from one regex pass over comments and string
  literals, which finds the same comments as `tokenize` (a test checks it) at a fraction of its cost. Only
  full-line comments are kept (trailing ones are mostly tags such as `# noqa`), grouped into blocks of
  consecutive lines. Parsing dominates the time (about 20 CPU-seconds for the whole 3.11 stdlib).
- `hf:NAME[:CONFIG]`: any hub dataset with a `text` column, split `train`; streamed when `max_docs` bounds it.
- `files:GLOB`: `.txt` and gzip-compressed text (`.txt.gz`, info manuals `*.info.gz`, `*.info-1.gz`) split into
  documents at info node separators (0x1f) when the file has them, else at blank lines (paragraphs);
  `.jsonl` / `.jsonl.gz` with a `text` field per line; `.parquet` with a `text` column. One info node is a
  natural document (a manual section); paragraphs are the closest unit in plain prose.
  Files are decoded with `TextOptions` (`--encoding`, default utf-8; `--errors`, default strict: the first
  undecodable byte is an error naming the file and offset; `replace`/`ignore` replace or drop such bytes). A file
  whose share of undecodable bytes and control characters exceeds MAX_NOT_TEXT_SHARE is refused as not text,
  whatever `--errors` says: a tokenizer trained on binary data learns garbage pieces. Every read, decode or parse
  error names the file; a glob whose files hold no document is refused naming them.
"""

from __future__ import annotations

import ast
import codecs
import contextlib
import gc
import glob
import gzip
import itertools
import json
import logging
import multiprocessing
import os
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import datasets
from tqdm import tqdm

log = logging.getLogger(__name__)

ALLOWED_SOURCES = "stdlib-docs, hf:NAME[:CONFIG], files:GLOB"
ERRORS = ("strict", "replace", "ignore")
# Real prose has next to no control characters; random or binary bytes decode to several percent of them.
MAX_NOT_TEXT_SHARE = 0.01
# Control characters text files do hold: tab, newline, vertical tab, form feed, carriage return, and the info
# format's node separator 0x1f and tag-table separator DEL 0x7f. Every other C0 character and the C1 block count
# against MAX_NOT_TEXT_SHARE.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1e\x80-\x9f]")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")   # an undecodable byte under the surrogateescape handler
ALLOWED_FILE_TYPES = ".txt, .gz (text, e.g. .txt.gz, .info.gz), .jsonl, .jsonl.gz, .parquet"
# Shorter comment blocks are mostly tags (`# noqa`, `# type: ignore`, `# XXX`), not prose.
MIN_COMMENT_CHARS = 20
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Fields holding statement lists: docstrings only sit at the top of a def/class/module body.
_STATEMENT_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
# Comments and string literals scanned left to right, so a `#` inside a string (even a multi-line one) is eaten
# by its string and never read as a comment. Exact for Python <= 3.11 source; the nested same-quote f-strings that
# 3.12 allows (PEP 701) can put it out of step until the next string, costing at most a few stray documents.
_COMMENT_OR_STRING = re.compile(
    r"(?P<comment>#[^\n]*)"
    r"|[rRbBuUfF]{0,2}(?:"
    r'"""(?:[^"\\]|\\.|"(?!""))*"""'
    r"|'''(?:[^'\\]|\\.|'(?!''))*'''"
    r'|"(?:[^"\\\n]|\\.)*"'
    r"|'(?:[^'\\\n]|\\.)*')",
    re.DOTALL,
)
_INFO_NODE_SEPARATOR = "\x1f"
_BLANK_LINES = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class TextOptions:
    """How `files:` sources decode bytes: a Python codec name and what to do with bytes it cannot decode."""

    encoding: str = "utf-8"
    errors: str = "strict"

    def __post_init__(self) -> None:
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise ValueError(f"--encoding: got {self.encoding!r}; allowed: a Python codec name, e.g. utf-8, "
                             "latin-1, cp1252") from None
        if self.errors not in ERRORS:
            raise ValueError(f"--errors: got {self.errors!r}; allowed: {', '.join(ERRORS)}")


@dataclass(frozen=True)
class Source:
    """A parsed `--source`: kind is `stdlib-docs`, `hf` (arg = dataset name) or `files` (arg = glob)."""

    kind: str
    arg: str = ""
    config: str | None = None


def parse_source(spec: str) -> Source:
    """Parse `stdlib-docs`, `hf:NAME[:CONFIG]` or `files:GLOB`; anything else is a ValueError."""
    if spec == "stdlib-docs":
        return Source("stdlib-docs")
    scheme, _, rest = spec.partition(":")
    if scheme == "hf" and rest:
        name, _, config = rest.partition(":")
        if name:
            return Source("hf", name, config or None)
    if scheme == "files" and rest:
        return Source("files", rest)
    raise ValueError(f"--source: got {spec!r}; allowed: {ALLOWED_SOURCES}")


def load_documents(source: Source, *, max_docs: int | None = None, num_proc: int = 1,
                   text: TextOptions = TextOptions()) -> datasets.Dataset:
    """The source's documents (non-blank, in source order, at most `max_docs`) as a Dataset with column `text`;
    `text` decodes `files:` sources."""
    if source.kind == "hf":
        return _hf_documents(source, max_docs)
    docs = stdlib_documents(num_proc) if source.kind == "stdlib-docs" else file_documents(source.arg, text)
    return datasets.Dataset.from_dict({"text": list(itertools.islice(docs, max_docs))})


# ----------------------------------------------------------------------------------------------- stdlib-docs

def stdlib_files() -> list[Path]:
    """The standard library's `.py` files in sorted path order (installed packages excluded)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, names in os.walk(root):  # os.walk: ~30x faster than Path.rglob here
        if folder == root and "site-packages" in subfolders:
            subfolders.remove("site-packages")
        found += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    return [Path(path) for path in sorted(found)]


def stdlib_documents(num_proc: int = 1) -> Iterator[str]:
    """Docstrings and comment blocks of the stdlib, file by file; `num_proc` processes parse in parallel."""
    files = stdlib_files()
    with contextlib.ExitStack() as stack:
        if num_proc > 1:
            # imap keeps file order; when a consumer stops early (max_docs) and drops this generator, the
            # exit stack terminates the pool.
            pool = stack.enter_context(multiprocessing.Pool(num_proc))
            per_file = pool.imap(_read_python_file, files, chunksize=8)
        else:
            per_file = map(_read_python_file, files)
        for docs in tqdm(per_file, total=len(files), desc="stdlib-docs: parse", unit="file"):
            yield from docs


def _read_python_file(path: Path) -> list[str]:
    return python_file_documents(path.read_bytes())


def python_file_documents(source: bytes) -> list[str]:
    """Docstrings (cleaned by `inspect.cleandoc`) and comment blocks of one Python file, in line order.

    A comment block is a run of consecutive full-line comments, `#` and one following space stripped from each
    line. Files that do not parse (Python 2 test data, deliberately broken files) give no documents.
    """
    # AST nodes hold no reference cycles, so refcounting frees them; with the cyclic collector on, the many
    # allocations of a parse trigger full-heap scans that cost about a third of the extraction time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    finally:
        if gc_was_enabled:
            gc.enable()
    found = _docstrings(tree, []) + _comment_blocks(source.decode("utf-8", errors="replace"))
    found.sort(key=lambda item: item[0])  # stable: a docstring and a comment block never share a line
    return [text for _, text in found]


def _docstrings(node: ast.AST, found: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line, docstring) of `node` and of every def/class below it; only statement lists are visited."""
    if isinstance(node, _DOC_NODES):
        doc = ast.get_docstring(node)
        if doc and doc.strip():
            found.append((node.body[0].lineno, doc))
    for field in _STATEMENT_FIELDS:
        for child in getattr(node, field, None) or ():
            _docstrings(child, found)
    return found


def _comment_blocks(text: str) -> list[tuple[int, str]]:
    """(first line, text) of every run of full-line comments of at least MIN_COMMENT_CHARS characters."""
    found: list[tuple[int, str]] = []
    block: list[str] = []
    block_start, last_line = 0, -1
    line, pos = 1, 0
    for match in _COMMENT_OR_STRING.finditer(text):
        comment = match.group("comment")
        if comment is None:
            continue
        line += text.count("\n", pos, match.start())
        pos = match.start()
        if comment.startswith(("#!", "# -*-")) or text[text.rfind("\n", 0, pos) + 1: pos].strip():
            continue  # shebang, coding cookie, or a trailing comment after code
        if line != last_line + 1:
            _flush_comment_block(block, block_start, found)
            block, block_start = [], line
        block.append(comment[2:] if comment.startswith("# ") else comment[1:])
        last_line = line
    _flush_comment_block(block, block_start, found)
    return found


def _flush_comment_block(block: list[str], line: int, found: list[tuple[int, str]]) -> None:
    text = "\n".join(block).strip()
    if len(text) >= MIN_COMMENT_CHARS:
        found.append((line, text))


# ----------------------------------------------------------------------------------------------------- files

def file_documents(pattern: str, text: TextOptions = TextOptions()) -> Iterator[str]:
    """Documents of every file matching `pattern` (sorted), by file type (module docstring)."""
    paths = sorted(glob.glob(pattern, recursive=True))
    if not paths:
        raise ValueError(f"--source files:{pattern}: no file matches this glob; allowed types: {ALLOWED_FILE_TYPES}")
    for path in paths:
        _file_kind(path)  # refuse an unknown type before any work
    found = 0
    for path in tqdm(paths, desc="files: read", unit="file"):
        docs = read_file_documents(path, text)
        if not docs and len(paths) > 1:
            log.warning("no documents in %s", path)
        found += len(docs)
        yield from docs
    if not found:
        raise ValueError(f"--source files:{pattern}: no documents in {', '.join(paths)}; allowed: files holding "
                         f"non-blank text")


def _file_kind(path: str) -> str:
    name = path.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".txt", ".gz")):
        return "text"
    raise ValueError(f"--source files: file {path!r} has an unsupported type; allowed: {ALLOWED_FILE_TYPES}")


def read_file_documents(path: str, text: TextOptions = TextOptions()) -> list[str]:
    """The non-blank documents of one file; ValueError naming the file for anything unreadable or not text."""
    kind = _file_kind(path)
    undecodable = 0
    if kind == "parquet":
        docs: Iterable[str] = _parquet_texts(path)
    else:
        content, undecodable = read_text(path, text)
        docs = list(_jsonl_texts(path, content)) if kind == "jsonl" else split_text_documents(content)
    docs = [doc for doc in docs if doc and doc.strip()]
    check_is_text(path, docs, undecodable, text)
    return docs


def check_is_text(path: str, docs: list[str], undecodable: int, text: TextOptions = TextOptions()) -> None:
    """Refuse a file whose undecodable bytes plus control characters exceed MAX_NOT_TEXT_SHARE of its text."""
    chars = sum(len(doc) for doc in docs) + (undecodable if text.errors == "ignore" else 0)
    control = sum(len(_CONTROL.findall(doc)) for doc in docs)
    share = (undecodable + control) / max(1, chars)
    if share > MAX_NOT_TEXT_SHARE:
        raise ValueError(f"{path}: not text: {share:.1%} of it is undecodable bytes ({undecodable}, as "
                         f"{text.encoding}) or control characters ({control}); allowed: at most "
                         f"{MAX_NOT_TEXT_SHARE:.0%} (is it {text.encoding}? --encoding names another encoding)")


def read_bytes(path: str) -> bytes:
    """The file's bytes, gunzipped for `.gz`; ValueError naming the file when it cannot be read."""
    gz = path.lower().endswith(".gz")
    try:
        if gz:
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as err:   # gzip.BadGzipFile is an OSError
        what = "gzip-compressed" if gz else "readable"
        raise ValueError(f"{path}: not a {what} file ({err}); allowed types: {ALLOWED_FILE_TYPES}") from None


def read_text(path: str, text: TextOptions = TextOptions()) -> tuple[str, int]:
    """(decoded text, number of undecodable bytes): `strict` refuses the first one naming its offset, `replace`
    puts U+FFFD in its place, `ignore` drops it."""
    data = read_bytes(path)
    try:
        decoded = data.decode(text.encoding, "strict" if text.errors == "strict" else "surrogateescape")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: byte {err.start} is not valid {text.encoding} ({err.reason}); allowed: "
                         f"{text.encoding} text; --encoding names another encoding, --errors replace or ignore "
                         f"replaces or drops undecodable bytes") from None
    undecodable = len(_ESCAPED_BYTE.findall(decoded))
    if undecodable:
        log.warning("%s: %d undecodable bytes (as %s) %s", path, undecodable, text.encoding,
                    "replaced by U+FFFD" if text.errors == "replace" else "dropped")
        decoded = _ESCAPED_BYTE.sub("\ufffd" if text.errors == "replace" else "", decoded)
    return decoded, undecodable


def _jsonl_texts(path: str, content: str) -> Iterator[str]:
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); allowed: one "
                             f"JSON object with a string 'text' field per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{lineno}: a .jsonl line must be an object with a string 'text' field")
        yield record["text"]


def _parquet_texts(path: str) -> list[str]:
    import pyarrow as pa  # datasets depends on pyarrow
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if "text" not in schema.names:
            raise ValueError(f"{path}: parquet file has no 'text' column; columns: {schema.names}")
        return pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None


def split_text_documents(text: str) -> list[str]:
    """Info node separators when present, else blank-line paragraphs; surrounding blank lines dropped."""
    parts = text.split(_INFO_NODE_SEPARATOR) if _INFO_NODE_SEPARATOR in text else _BLANK_LINES.split(text)
    return [part.strip("\n") for part in parts if part.strip()]


# -------------------------------------------------------------------------------------------------------- hf

def _hf_documents(source: Source, max_docs: int | None) -> datasets.Dataset:
    if max_docs is None:
        ds = datasets.load_dataset(source.arg, source.config, split="train")
        _check_text_column(source, ds.column_names)
        return ds.select_columns(["text"]).filter(lambda t: bool(t.strip()), input_columns="text")
    stream = datasets.load_dataset(source.arg, source.config, split="train", streaming=True)
    _check_text_column(source, stream.column_names)
    texts = (row["text"] for row in stream if row["text"].strip())
    return datasets.Dataset.from_dict({"text": list(tqdm(itertools.islice(texts, max_docs), desc="hf: stream"))})


def _check_text_column(source: Source, columns: list[str] | None) -> None:
    # A streamed dataset may not know its columns before the first row; then the row lookup fails loudly.
    if columns is not None and "text" not in columns:
        raise ValueError(f"--source hf:{source.arg}: the dataset has no 'text' column; columns: {columns}")
