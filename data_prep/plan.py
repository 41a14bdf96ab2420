"""The state of a preparation on disk: its plan, the records of finished parts, the budget, the lock.

Owns the layout of the output directory besides meta.json and the tokenizer (prepare.py, finalize.py):

    OUT/prep.json              settings (everything that changes the output), the parts, the installed tokenizer
    OUT/parts/NNNNN.json       one record per finished part (written last and atomically: the completion marker)
    OUT/shards/SPLIT-NNNNN.bin + .idx   the part's shards (distsparse/data/shards.py)

A part's record names its shard files with their sizes and sha256; a record whose files are missing or of
another size is discarded (the part is redone), so a preparation killed at any point continues from its finished
parts. The output is a pure function of the settings: parts are read, tokenized and held out (val) independently
of how many workers or SLURM tasks ran them.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from data_prep.readers import ReadOptions, TextOptions
from data_prep.sources import Part

SPLITS = ("train", "val")
PLAN_FILE = "prep.json"
TOKENIZER_DIR = "tokenizer"


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Budget:
    """`--max-docs` (source documents, both splits) and `--max-tokens` (training tokens): the preparation keeps the
    shortest prefix of the source that meets either."""

    max_docs: int | None = None
    max_tokens: int | None = None

    def met(self, num_docs: int, train_tokens: int) -> bool:
        return ((self.max_docs is not None and num_docs >= self.max_docs)
                or (self.max_tokens is not None and train_tokens >= self.max_tokens))


@dataclass
class Plan:
    out: Path
    settings: dict
    parts: list[Part]
    tokenizer: dict | None = None   # kind, facts (tokenizer.py), dtype, check; None until installed

    # ---- files ----------------------------------------------------------------------------------------------

    @property
    def tokenizer_dir(self) -> Path:
        return self.out / TOKENIZER_DIR

    def record_path(self, index: int) -> Path:
        return self.out / "parts" / f"{index:05d}.json"

    def shard_path(self, split: str, index: int, suffix: str = "") -> Path:
        return self.out / "shards" / f"{split}-{index:05d}{suffix}.bin"

    @classmethod
    def load(cls, out: Path) -> "Plan | None":
        path = Path(out) / PLAN_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(Path(out), data["settings"], [Part.from_dict(p) for p in data["parts"]], data["tokenizer"])

    def save(self) -> None:
        (self.out / "parts").mkdir(parents=True, exist_ok=True)
        (self.out / "shards").mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out / PLAN_FILE, {"settings": self.settings, "tokenizer": self.tokenizer,
                                                 "parts": [p.to_dict() for p in self.parts]})

    # ---- settings ---------------------------------------------------------------------------------------------

    @property
    def read_options(self) -> ReadOptions:
        s = self.settings
        return ReadOptions(TextOptions(s["encoding"], s["errors"]), s["text_key"], s["format"])

    @property
    def budget(self) -> Budget:
        return Budget(self.settings["max_docs"], self.settings["max_tokens"])

    # ---- records ----------------------------------------------------------------------------------------------

    def write_record(self, index: int, record: dict) -> None:
        write_json_atomic(self.record_path(index), record)

    def records(self) -> dict[int, dict]:
        """Records of finished parts whose shard files are there at their recorded sizes; others are removed."""
        found = {}
        for index in range(len(self.parts)):
            path = self.record_path(index)
            if not path.is_file():
                continue
            record = json.loads(path.read_text())
            shards = [self.out / "shards" / s["file"] for s in record["splits"].values()]
            sizes_ok = all(f.is_file() and f.stat().st_size == s["bytes"]
                           for f, s in zip(shards, record["splits"].values()))
            indexes_ok = all(f.with_suffix(".idx").is_file() for f in shards)
            if sizes_ok and indexes_ok:
                found[index] = record
            else:
                path.unlink()
        return found

    def usage(self, records: dict[int, dict]) -> tuple[list[int], int | None]:
        """(parts the output is made of, as far as known; the first part with no record among them, or None when
        they are all finished). A part is used unless the finished parts before it already meet the budget."""
        used, docs, tokens = [], 0, 0
        for index in range(len(self.parts)):
            if self.budget.met(docs, tokens):
                break
            used.append(index)
            if index not in records:
                return used, index
            docs += records[index]["num_docs"]
            tokens += records[index]["splits"]["train"]["num_tokens"]
        return used, None


class OutLock:
    """OUT/.lock holding this process's host and pid: a second preparation into the same directory is refused
    while the first runs; a lock left by a killed one (dead pid on this host) is taken over."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / ".lock"
        self.mine = f"{socket.gethostname()} {os.getpid()}"

    def __enter__(self) -> "OutLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                host, _, pid = self.path.read_text().partition(" ")
                if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
                    self.path.unlink(missing_ok=True)
                    continue
                raise ValueError(f"--out: {self.path.parent} is being prepared by another process ({host} pid "
                                 f"{pid}, see {self.path}); allowed: one preparation per directory at a time (remove "
                                 f"the lock file if that process is gone)") from None
            with os.fdopen(fd, "w") as f:
                f.write(self.mine)
            return self

    def __exit__(self, *exc) -> None:
        if self.path.is_file() and self.path.read_text() == self.mine:
            self.path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
