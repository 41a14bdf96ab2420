"""Documents of one file, streamed: the kind decided by name and checked by content, decoded, split, counted.

Owns reading a file (or a byte range or row groups of one) into non-blank documents with bounded memory (a block
of text plus the document being assembled); sources.py decides which files and ranges make a part.

Kinds by name (compression `.gz` / `.zst` stripped first; `--format` forces a kind for every file):
- JSON lines: `.jsonl`, `.json` (C4's `c4-train.00000-of-01024.json.gz`, The Pile's `.jsonl.zst`): one JSON object
  per line, its `--text-key` field (default `text`) a document. An uncompressed file can be read by byte range:
  a range owns the lines that start inside it.
- parquet: `.parquet`, the `--text-key` column, by row groups (FineWeb, HF hub exports).
- text: `.txt` and other compressed files (info manuals `*.info.gz`): split at info node separators (0x1f) when
  the first MiB of the file holds one, else at blank lines (paragraphs). A text file whose first line is a JSON
  object is refused naming the file and `--format jsonl` (JSON read as text would become raw-JSON documents).
Decoding (`--encoding`, `--errors`): `strict` refuses the first undecodable byte naming the file and offset,
`replace`/`ignore` replace or drop such bytes. A file whose share of undecodable bytes and control characters
exceeds MAX_NOT_TEXT_SHARE is refused as not text whatever `--errors` says: a tokenizer trained on binary data
learns garbage pieces.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import logging
import re
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Iterable, Iterator

log = logging.getLogger(__name__)

ERRORS = ("strict", "replace", "ignore")
FORMATS = ("auto", "jsonl", "parquet", "text")
COMPRESSIONS = (".gz", ".zst")
ALLOWED_FILE_TYPES = (".jsonl, .json (JSON lines), .parquet, .txt; .jsonl, .json and .txt also as .gz or .zst "
                      "(other .gz/.zst files, e.g. info manuals, are text)")
# Real prose has next to no control characters; random or binary bytes decode to several percent of them.
MAX_NOT_TEXT_SHARE = 0.01
# Control characters text files do hold: tab, newline, vertical tab, form feed, carriage return, and the info
# format's node separator 0x1f and tag-table separator DEL 0x7f. Every other C0 character and the C1 block count
# against MAX_NOT_TEXT_SHARE.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1e\x80-\x9f]")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")   # an undecodable byte under the surrogateescape handler
_NODE_SEPARATOR = re.compile("\x1f")
_BLANK_LINES = re.compile(r"\n[ \t]*\n")
BLOCK_BYTES = 1 << 20    # read and decode unit; also how far into a text file the info-node check looks


@dataclass(frozen=True)
class TextOptions:
    """How files are decoded: a Python codec name and what to do with bytes it cannot decode."""

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
class ReadOptions:
    """Everything about reading that changes the documents: decoding, the JSON/parquet field, a forced kind."""

    text: TextOptions = TextOptions()
    text_key: str = "text"
    format: str = "auto"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"--format: got {self.format!r}; allowed: {', '.join(FORMATS)}")
        if not self.text_key:
            raise ValueError("--text-key: got ''; allowed: the name of the field holding each document's text")


def file_kind(path: str, forced: str = "auto") -> str:
    """`jsonl`, `parquet` or `text` from the file name (or `forced`); ValueError naming an unknown type."""
    name = path.lower()
    compressed = name.endswith(COMPRESSIONS)
    base = name.rsplit(".", 1)[0] if compressed else name
    if forced != "auto":
        return forced
    if base.endswith((".jsonl", ".json")):
        return "jsonl"
    if base.endswith(".parquet") and not compressed:
        return "parquet"
    if base.endswith(".txt") or compressed:
        return "text"
    raise ValueError(f"--source files: file {path!r} has an unsupported type; allowed: {ALLOWED_FILE_TYPES}")


def open_binary(path: str) -> BinaryIO:
    """The file's bytes, decompressed for `.gz` / `.zst`, as a buffered stream."""
    name = path.lower()
    raw = open(path, "rb")
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if name.endswith(".zst"):
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def _read_error(path: str, err: Exception) -> ValueError:
    name = path.lower()
    what = "gzip-compressed" if name.endswith(".gz") else "zstd-compressed" if name.endswith(".zst") else "readable"
    return ValueError(f"{path}: not a {what} file ({err}); allowed types: {ALLOWED_FILE_TYPES}")


class TextCounter:
    """Undecodable bytes and control characters of one file's documents, for the not-text refusal."""

    def __init__(self, path: str, text: TextOptions) -> None:
        self.path, self.text = path, text
        self.chars = self.control = self.undecodable = 0

    def clean(self, decoded: str) -> str:
        """`decoded` (surrogateescape) with undecodable bytes counted, then replaced or dropped."""
        found = len(_ESCAPED_BYTE.findall(decoded))
        if found:
            self.undecodable += found
            decoded = _ESCAPED_BYTE.sub("\ufffd" if self.text.errors == "replace" else "", decoded)
        return decoded

    def count(self, doc: str) -> str:
        self.chars += len(doc)
        self.control += len(_CONTROL.findall(doc))
        return doc

    def check(self) -> None:
        """Refuse the file if undecodable bytes plus control characters exceed MAX_NOT_TEXT_SHARE of its text."""
        chars = self.chars + (self.undecodable if self.text.errors == "ignore" else 0)
        share = (self.undecodable + self.control) / max(1, chars)
        if share > MAX_NOT_TEXT_SHARE:
            enc = self.text.encoding
            raise ValueError(f"{self.path}: not text: {share:.1%} of it is undecodable bytes ({self.undecodable}, as "
                             f"{enc}) or control characters ({self.control}); allowed: at most "
                             f"{MAX_NOT_TEXT_SHARE:.0%} (is it {enc}? --encoding names another encoding)")
        if self.undecodable:
            log.warning("%s: %d undecodable bytes (as %s) %s", self.path, self.undecodable, self.text.encoding,
                        "replaced by U+FFFD" if self.text.errors == "replace" else "dropped")


def decoded_blocks(path: str, stream: BinaryIO, counter: TextCounter) -> Iterator[str]:
    """The stream decoded block by block; `strict` names the file and the offset of the first undecodable byte."""
    text = counter.text
    decoder = codecs.getincrementaldecoder(text.encoding)("strict" if text.errors == "strict" else "surrogateescape")
    offset = 0
    while True:
        try:
            block = stream.read(BLOCK_BYTES)
        except (OSError, EOFError, zlib.error) as err:   # gzip.BadGzipFile is an OSError
            raise _read_error(path, err) from None
        try:
            decoded = decoder.decode(block, final=not block)
        except UnicodeDecodeError as err:
            at = offset - len(decoder.getstate()[0]) + err.start
            raise ValueError(f"{path}: byte {at} is not valid {text.encoding} ({err.reason}); allowed: "
                             f"{text.encoding} text; --encoding names another encoding, --errors replace or ignore "
                             f"replaces or drops undecodable bytes") from None
        offset += len(block)
        if decoded:
            yield counter.clean(decoded)
        if not block:
            return


def split_blocks(blocks: Iterable[str], separator: re.Pattern) -> Iterator[str]:
    """The pieces between `separator` matches of the concatenated blocks, holding one unfinished piece at a time.

    A match may start inside the held piece only at its last newline (both separators here begin at a newline or
    are one character), so each block is searched from there."""
    pending = ""
    for block in blocks:
        buffer = pending + block
        cut = pending.rfind("\n")
        start_search = cut if cut >= 0 and not pending[cut + 1:].strip(" \t") else len(pending)
        start = 0
        for match in separator.finditer(buffer, start_search):
            yield buffer[start: match.start()]
            start = match.end()
        pending = buffer[start:]
    yield pending


def text_documents(path: str, text: TextOptions = TextOptions()) -> Iterator[str]:
    """Documents of a text file: info nodes when its first block holds a separator, else paragraphs."""
    counter = TextCounter(path, text)
    with open_binary(path) as stream:
        blocks = decoded_blocks(path, stream, counter)
        first = next(blocks, "")
        _refuse_json_as_text(path, first)
        separator = _NODE_SEPARATOR if "\x1f" in first else _BLANK_LINES
        for piece in split_blocks(_chain_first(first, blocks), separator):
            doc = piece.strip("\n")
            if doc.strip():
                yield counter.count(doc)
    counter.check()


def _chain_first(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _refuse_json_as_text(path: str, first_block: str) -> None:
    line = next((ln for ln in first_block.split("\n") if ln.strip()), "")
    if line.lstrip().startswith("{"):
        try:
            is_object = isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            is_object = False
        if is_object:
            raise ValueError(f"{path}: named as text, but its first line is a JSON object; read as text, every JSON "
                             f"record would become raw JSON in a document; allowed: --format jsonl (reads the "
                             f"'text' field of each line, --text-key names another) or a .jsonl/.json name")


def jsonl_documents(path: str, opts: ReadOptions = ReadOptions(), start: int = 0,
                    stop: int | None = None) -> Iterator[str]:
    """The `opts.text_key` field of each JSON line; with `start`/`stop` (uncompressed files only) the lines that
    begin at a byte offset in [start, stop)."""
    counter = TextCounter(path, opts.text)
    key, errors = opts.text_key, "strict" if opts.text.errors == "strict" else "surrogateescape"
    with open_binary(path) as stream:
        if start:
            stream.seek(start - 1)
            stream.readline()   # the line running through `start` belongs to the previous range
        lineno = None if start else 0   # line numbers are known only when reading from the top
        position = stream.tell() if stop is not None else 0
        while stop is None or position < stop:
            try:
                raw = stream.readline()
            except (OSError, EOFError, zlib.error) as err:
                raise _read_error(path, err) from None
            if not raw:
                break
            where = f"{path}:{lineno + 1}" if lineno is not None else f"{path} (line at byte {position})"
            position += len(raw)
            lineno = None if lineno is None else lineno + 1
            try:
                line = counter.clean(raw.decode(opts.text.encoding, errors))
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: byte {err.start} of the line is not valid {opts.text.encoding}; "
                                 f"allowed: --encoding, or --errors replace or ignore") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); allowed: one JSON "
                                 f"object with a string {key!r} field per line") from None
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                found = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{where}: a JSON line must be an object with a string {key!r} field (found: "
                                 f"{found}); --text-key names the field")
            if record[key].strip():
                yield counter.count(record[key])
    counter.check()


def parquet_documents(path: str, opts: ReadOptions = ReadOptions(),
                      row_groups: tuple[int, int] | None = None) -> Iterator[str]:
    """The `opts.text_key` column of a parquet file (row groups [a, b) when given), in batches."""
    import pyarrow as pa  # datasets depends on pyarrow
    import pyarrow.parquet as pq

    counter = TextCounter(path, opts.text)
    try:
        handle = pq.ParquetFile(path)
        if opts.text_key not in handle.schema_arrow.names:
            raise ValueError(f"{path}: parquet file has no {opts.text_key!r} column; columns: "
                             f"{handle.schema_arrow.names}; --text-key names the column")
        groups = range(*row_groups) if row_groups else range(handle.num_row_groups)
        for batch in handle.iter_batches(batch_size=1024, columns=[opts.text_key], row_groups=list(groups)):
            for value in batch.column(0).to_pylist():
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"{path}: column {opts.text_key!r} holds {type(value).__name__} values; "
                                     "allowed: strings")
                if value and value.strip():
                    yield counter.count(value)
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    counter.check()


def file_documents(path: str, opts: ReadOptions = ReadOptions(), start: int = 0, stop: int | None = None,
                   row_groups: tuple[int, int] | None = None) -> Iterator[str]:
    """Documents of one file (or of its byte range / row groups) by kind."""
    kind = file_kind(path, opts.format)
    if kind == "jsonl":
        return jsonl_documents(path, opts, start, stop)
    if kind == "parquet":
        return parquet_documents(path, opts, row_groups)
    return text_documents(path, opts.text)


def read_file_documents(path: str, text: TextOptions = TextOptions(), text_key: str = "text") -> list[str]:
    """All documents of one file (tests and small tools; preparation streams them)."""
    return list(file_documents(path, ReadOptions(text=text, text_key=text_key)))
