"""Document sources: `--source` parsed, planned into parts, and each part read as a stream of documents.

Owns the unit of work of a preparation, the *part*: a fixed slice of the source whose documents one worker reads,
tokenizes and writes into its own shards (parts.py). The plan (the list of parts) is a pure function of the source
and the settings, so a restarted preparation and every SLURM task see the same parts (datatrove's model: tasks own
files, a completed task is skipped on restart). Does not tokenize or split. research/pretraining_ecosystem.md s2.

- `stdlib-docs`: the docstrings and full-line comment blocks of the running Python's standard library (the
  `.py` files under `sysconfig`'s stdlib path, `site-packages` excluded), present on every machine, no network.
  Files are read in sorted path order and each file's documents in line order, so the corpus is a pure function
  of the Python version; STDLIB_FILES_PER_PART files make a part. Docstrings come from `ast`; comments from one
  regex pass over comments and string literals, which finds the same comments as `tokenize` (a test checks it) at
  a fraction of its cost. Only full-line comments are kept (trailing ones are mostly tags such as `# noqa`),
  grouped into blocks of consecutive lines. Parsing dominates the time (about 20 CPU-seconds for the 3.11 stdlib).
- `hf:NAME[:CONFIG]`: a hub dataset by name, or a local folder (of data files, or written by `save_to_disk`),
  split `train`, always streamed (no full download): one part per shard of the streaming dataset (its data files),
  or PART_ROWS rows of a `save_to_disk` folder.
- `files:GLOB`: the kinds of readers.py (JSON lines, parquet, text; `.gz`/`.zst`), files in sorted order; an
  uncompressed JSON-lines file larger than `part_bytes` is cut into byte ranges, a parquet file into runs of row
  groups of about `part_bytes`; any other file is one part.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import glob
import logging
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from data_prep.readers import COMPRESSIONS, ReadOptions, file_documents, file_kind

log = logging.getLogger(__name__)

ALLOWED_SOURCES = "stdlib-docs, hf:NAME[:CONFIG], files:GLOB"
STDLIB_FILES_PER_PART = 64
PART_ROWS = 100_000          # rows of a save_to_disk dataset per part
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


@dataclass(frozen=True)
class Source:
    """A parsed `--source`: kind is `stdlib-docs`, `hf` (arg = dataset name or folder) or `files` (arg = glob)."""

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


@dataclass(frozen=True)
class Part:
    """One slice of the source. kind: `stdlib` (files), `file` (path; byte range [start, stop) or row groups),
    `hf` (shard `shard` of `num_shards` of dataset `path`), `hf_disk` (rows [start, stop) of a saved folder)."""

    kind: str
    path: str = ""
    files: tuple[str, ...] = ()
    start: int = 0
    stop: int | None = None
    row_groups: tuple[int, int] | None = None
    config: str | None = None
    shard: int = 0
    num_shards: int = 1

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v != getattr(Part, k, None) or k == "kind"}

    @classmethod
    def from_dict(cls, data: dict) -> "Part":
        data = dict(data)
        for key in ("files", "row_groups"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)

    def describe(self) -> str:
        if self.kind == "stdlib":
            return f"stdlib {self.files[0]} .. {self.files[-1]}"
        if self.kind == "hf":
            return f"hf:{self.path} shard {self.shard}/{self.num_shards}"
        if self.row_groups:
            return f"{self.path} row groups {self.row_groups[0]}..{self.row_groups[1] - 1}"
        return f"{self.path}" + (f" bytes {self.start}..{self.stop}" if self.stop is not None else "")


def plan_parts(source: Source, opts: ReadOptions, part_bytes: int) -> list[Part]:
    """The parts of a source, in source order."""
    if source.kind == "stdlib-docs":
        files = [str(p) for p in stdlib_files()]
        return [Part("stdlib", files=tuple(files[i: i + STDLIB_FILES_PER_PART]))
                for i in range(0, len(files), STDLIB_FILES_PER_PART)]
    if source.kind == "hf":
        return _hf_parts(source, opts)
    return _file_parts(source.arg, opts, part_bytes)


def part_documents(part: Part, opts: ReadOptions) -> Iterator[str]:
    """The part's non-blank documents in source order, streamed."""
    if part.kind == "stdlib":
        return (doc for path in part.files for doc in python_file_documents(Path(path).read_bytes()))
    if part.kind in ("hf", "hf_disk"):
        return _hf_documents(part, opts)
    return _counted(part, file_documents(part.path, opts, part.start, part.stop, part.row_groups))


def iter_documents(source: Source, opts: ReadOptions = ReadOptions(), part_bytes: int = 1 << 27) -> Iterator[str]:
    """Every document of the source in plan order (tests and small tools; a preparation reads parts in workers)."""
    for part in plan_parts(source, opts, part_bytes):
        yield from part_documents(part, opts)


def _counted(part: Part, docs: Iterator[str]) -> Iterator[str]:
    found = 0
    for doc in docs:
        found += 1
        yield doc
    if not found:
        log.warning("no documents in %s", part.describe())


# ----------------------------------------------------------------------------------------------------- files

def _file_parts(pattern: str, opts: ReadOptions, part_bytes: int) -> list[Part]:
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        raise ValueError(f"--source files:{pattern}: no file matches this glob")
    kinds = {path: file_kind(path, opts.format) for path in paths}   # refuse an unknown type before any work
    parts = []
    for path in paths:
        size = os.path.getsize(path)
        if kinds[path] == "jsonl" and not path.lower().endswith(COMPRESSIONS) and size > part_bytes:
            parts += [Part("file", path, start=a, stop=min(size, a + part_bytes)) for a in range(0, size, part_bytes)]
        elif kinds[path] == "parquet":
            parts += [Part("file", path, row_groups=groups) for groups in _row_group_runs(path, part_bytes)]
        else:
            parts.append(Part("file", path))
    return parts


def _row_group_runs(path: str, part_bytes: int) -> list[tuple[int, int]]:
    """[a, b) runs of consecutive row groups of about `part_bytes` uncompressed bytes each."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        meta = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException) as err:
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    runs, first, size = [], 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= part_bytes:
            runs.append((first, group + 1))
            first, size = group + 1, 0
    if first < meta.num_row_groups or not runs:
        runs.append((first, meta.num_row_groups))
    return runs


# -------------------------------------------------------------------------------------------------------- hf

def _is_saved_dataset(folder: Path) -> bool:
    return folder.is_dir() and any((folder / f).is_file() for f in ("state.json", "dataset_dict.json"))


def _load_saved(folder: Path):
    import datasets
    ds = datasets.load_from_disk(str(folder))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"--source hf:{folder}: the saved dataset has no 'train' split; splits: {list(ds)}")
        ds = ds["train"]
    return ds


def _hf_stream(source_name: str, config: str | None):
    import datasets
    return datasets.load_dataset(source_name, config, split="train", streaming=True)


def _check_text_column(name: str, columns: list[str] | None, key: str) -> None:
    # A streamed dataset may not know its columns before the first row; then the row lookup below says the same.
    if columns is not None and key not in columns:
        raise ValueError(f"--source hf:{name}: the dataset has no {key!r} column; columns: {columns}; --text-key "
                         f"names the column")


def _hf_parts(source: Source, opts: ReadOptions) -> list[Part]:
    folder = Path(source.arg)
    if _is_saved_dataset(folder):
        ds = _load_saved(folder)
        _check_text_column(source.arg, ds.column_names, opts.text_key)
        return [Part("hf_disk", source.arg, start=a, stop=min(len(ds), a + PART_ROWS))
                for a in range(0, len(ds), PART_ROWS)]
    stream = _hf_stream(source.arg, source.config)
    _check_text_column(source.arg, stream.column_names, opts.text_key)
    n = stream.num_shards
    return [Part("hf", source.arg, config=source.config, shard=i, num_shards=n) for i in range(n)]


def _hf_documents(part: Part, opts: ReadOptions) -> Iterator[str]:
    key = opts.text_key
    if part.kind == "hf_disk":
        ds = _load_saved(Path(part.path)).select_columns([key])
        rows = (text for a in range(part.start, part.stop, 1000) for text in ds[a: min(part.stop, a + 1000)][key])
    else:
        stream = _hf_stream(part.path, part.config)
        if part.num_shards > 1:
            stream = stream.shard(num_shards=part.num_shards, index=part.shard)
        rows = (_text_field(part, row, key) for row in stream)
    for text in rows:
        if not isinstance(text, str):
            raise ValueError(f"--source hf:{part.path}: column {key!r} holds {type(text).__name__} values; allowed: "
                             "strings")
        if text.strip():
            yield text


def _text_field(part: Part, row: dict, key: str):
    if key not in row:
        _check_text_column(part.path, sorted(row), key)
    return row[key]


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


