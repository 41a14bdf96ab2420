"""Sharded, atomic checkpoints: DeepSpeed's part, the backbone engine's per-owner shards, a manifest.

Layout of `root/` (DESIGN decision 6):

    latest                          tag of the newest complete checkpoint, written last (tmp + rename)
    step00000120/
      manifest.json                 rank 0: format, world size, owner map, step, consumed samples, config,
                                    tokenizer checksum, NS coefficients, FFN rounding, size + sha256 of files
      backbone/rank00000.safetensors  each rank: fp32 master, codes and rule state of the matrices it owns
      dense_state.safetensors       rank 0: the dense side's fp32 masters and Adam moments by parameter name,
                                    so a run can resume on another world size (ZeRO files are per-partition)
      registry.safetensors          rank 0: state of registered components (e.g. permutations)
      rng/rank00000.json            each rank: python, numpy and torch RNG states
      mp_rank_00_model_states.pt, *_optim_states.pt   DeepSpeed (loaded by DeepSpeed only)

A checkpoint is written under `.tmp-<tag>/`, made durable, then renamed: a crash mid-save leaves the previous
checkpoint as `latest`. Project files are safetensors or JSON (no pickle); a truncated or corrupt file is
refused by name and `--resume auto` falls back to the previous complete checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from distsparse import dist as ddist

log = logging.getLogger("distsparse")
FORMAT_VERSION = 1
SEP = "::"   # flat safetensors key: "<matrix name>::<state key>"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def flatten_states(states: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{name}{SEP}{key}": t.detach().contiguous().cpu() for name, s in states.items() for key, t in s.items()}


def unflatten_states(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, _, sub = key.rpartition(SEP)
        out.setdefault(name, {})[sub] = t
    return out


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": repr(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict) -> None:
    import ast
    random.setstate(ast.literal_eval(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


@dataclass
class LoadedCheckpoint:
    path: Path
    manifest: dict


class CheckpointManager:
    """Owns save, load and atomicity of run checkpoints; what goes in comes from the trainer."""

    def __init__(self, root: str | Path, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last: got {keep_last}; allowed: an integer >= 1")
        self.root, self.keep_last = Path(root), keep_last
        self.rank, self.world_size = ddist.rank(), ddist.world_size()

    # ---- save ----------------------------------------------------------------------------------------------

    def save(self, step: int, *, ds_engine, matrix_engine, manifest: dict,
             dense_state: dict[str, torch.Tensor] | None = None,
             registry: dict[str, Stateful] | None = None) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint directory."""
        tag = tag_for(step)
        tmp_tag = f".tmp-{tag}"
        tmp, final = self.root / tmp_tag, self.root / tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        ddist.barrier()
        ds_engine.save_checkpoint(str(self.root), tag=tmp_tag, save_latest=False)
        written = self._write_rank_files(tmp, matrix_engine)
        if self.rank == 0:
            if dense_state is not None:
                save_file(dense_state, str(tmp / "dense_state.safetensors"))
                written.append("dense_state.safetensors")
            if registry:
                flat = flatten_states({name: obj.state_dict() for name, obj in registry.items()})
                save_file(flat, str(tmp / "registry.safetensors"))
                written.append("registry.safetensors")
        all_written = [f for files in ddist.gather_objects(written) for f in files]
        if self.rank == 0:
            files = {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in all_written}
            full = {"format_version": FORMAT_VERSION, "tag": tag, "step": step, "world_size": self.world_size,
                    "owners": matrix_engine.owners, "files": files, **manifest}
            (tmp / "manifest.json").write_text(json.dumps(full, indent=1))
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_text_atomic(self.root / "latest", tag)
            self._prune()
        ddist.barrier()
        return final

    def _write_rank_files(self, tmp: Path, matrix_engine) -> list[str]:
        rel = [f"backbone/rank{self.rank:05d}.safetensors", f"rng/rank{self.rank:05d}.json"]
        (tmp / "backbone").mkdir(parents=True, exist_ok=True)
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        save_file(flatten_states(matrix_engine.state_dict()), str(tmp / rel[0]))
        (tmp / rel[1]).write_text(json.dumps(rng_state()))
        return rel

    def _prune(self) -> None:
        tags = sorted(p.name for p in self.root.glob("step*") if p.is_dir())
        for old in tags[:-self.keep_last]:
            shutil.rmtree(self.root / old, ignore_errors=True)

    # ---- find and verify -----------------------------------------------------------------------------------

    def verify(self, path: Path) -> dict:
        """The manifest of a complete checkpoint, or CheckpointError naming the missing or corrupt file."""
        manifest_path = path / "manifest.json"
        if not manifest_path.exists():
            raise CheckpointError(f"checkpoint {path}: manifest.json is missing (incomplete save?)")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"checkpoint {manifest_path}: not valid JSON ({err})") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {manifest_path}: format_version {manifest.get('format_version')!r}; "
                                  f"this code reads {FORMAT_VERSION}")
        for rel, info in manifest["files"].items():
            f = path / rel
            if not f.exists():
                raise CheckpointError(f"checkpoint file {f} is missing")
            if f.stat().st_size != info["bytes"] or _sha256(f) != info["sha256"]:
                raise CheckpointError(f"checkpoint file {f} is truncated or corrupt "
                                      f"({f.stat().st_size} bytes, manifest says {info['bytes']})")
        return manifest

    def find(self, resume: str) -> LoadedCheckpoint | None:
        """`auto`: the newest complete checkpoint under root (falling back past corrupt ones with a warning),
        None when there is none; otherwise a checkpoint directory, refused with an error if unusable."""
        if resume != "auto":
            path = Path(resume)
            return LoadedCheckpoint(path, self.verify(path))
        if not self.root.exists():
            return None
        tags = sorted((p.name for p in self.root.glob("step*") if p.is_dir()), reverse=True)
        latest = (self.root / "latest").read_text().strip() if (self.root / "latest").exists() else None
        if latest in tags:   # `latest` first, then older ones
            tags.remove(latest)
            tags.insert(0, latest)
        for tag in tags:
            try:
                return LoadedCheckpoint(self.root / tag, self.verify(self.root / tag))
            except CheckpointError as err:
                log.warning("resume auto: skipping %s: %s", tag, err)
        return None

    # ---- load ----------------------------------------------------------------------------------------------

    def load_backbone(self, ckpt: LoadedCheckpoint, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """The saved state of `names`, read from whichever rank's file holds each (owners may differ now)."""
        owners = ckpt.manifest["owners"]
        by_file: dict[int, list[str]] = {}
        for name in names:
            if name not in owners:
                raise CheckpointError(f"checkpoint {ckpt.path}: no state for backbone matrix {name!r}")
            by_file.setdefault(owners[name], []).append(name)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for rank, wanted in by_file.items():
            path = ckpt.path / f"backbone/rank{rank:05d}.safetensors"
            with safe_open(str(path), framework="pt") as f:
                keys = [k for k in f.keys() if k.rpartition(SEP)[0] in set(wanted)]
                out.update(unflatten_states({k: f.get_tensor(k) for k in keys}))
        return out

    def load_tensors(self, ckpt: LoadedCheckpoint, rel: str) -> dict[str, torch.Tensor]:
        with safe_open(str(ckpt.path / rel), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def load_rng(self, ckpt: LoadedCheckpoint) -> None:
        path = ckpt.path / f"rng/rank{self.rank:05d}.json"
        if ckpt.manifest["world_size"] == self.world_size and path.exists():
            set_rng_state(json.loads(path.read_text()))
