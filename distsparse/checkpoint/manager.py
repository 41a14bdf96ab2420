"""Sharded, atomic checkpoints: save, find (verified, agreed on by every rank) and load.

Layout of `root/` (DESIGN decision 6):

    latest                          tag of the newest complete checkpoint, written last (tmp + rename)
    step00000120/
      manifest.json                 rank 0: format, world size, owner map, step, consumed samples, config,
                                    tokenizer checksum, NS coefficients, FFN rounding; every other file with its
                                    size, sha256 and the rank that wrote (and hashed) it; its own digest
      backbone/rank00000.safetensors  each rank: fp32 master, codes and rule state of the matrices it owns
      dense_state.safetensors       rank 0: the dense side's fp32 masters and Adam moments by parameter name,
                                    so a run can resume on another world size (ZeRO files are per-partition)
      registry.safetensors          rank 0: state of registered components (e.g. permutations)
      rng/rank00000.json            each rank: python, numpy and torch RNG states
      mp_rank_00_model_states.pt    DeepSpeed, written by its data-parallel writer (rank 0)
      zero_pp_rank_<r>_mp_rank_00_optim_states.pt   DeepSpeed, rank r's ZeRO partition (bf16_ prefix in bf16)

A checkpoint is written under `.tmp-<tag>/`, made durable, then renamed: a crash mid-save leaves the previous
checkpoint as `latest`. Each rank hashes the files it wrote; the digests are gathered into the manifest. Before
anything is loaded, every rank checks the manifest and the file sizes, hashes the files it wrote (manifest.py's
`verifier`), and one collective decides: `resume=auto` falls back past a checkpoint any rank found damaged, an
explicit path is refused; either way the file is named. Project files are safetensors or JSON (no pickle).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors import safe_open

from distsparse import dist as ddist
from distsparse.checkpoint.files import (
    SEP, flatten_states, fsync_dir, rng_state, save_safetensors, set_rng_state, sha256_and_sync, unflatten_states,
    write_text_atomic,
)
from distsparse.checkpoint.manifest import (
    FORMAT_VERSION, MANIFEST, CheckpointError, candidates, checkpoint_tags, read_manifest, sealed_text, tag_for,
    verify_digests,
)

log = logging.getLogger("distsparse")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


@dataclass
class LoadedCheckpoint:
    path: Path
    manifest: dict


def deepspeed_files(ds_engine, root: Path, tag: str) -> list[str]:
    """The files `ds_engine.save_checkpoint(root, tag)` wrote on this rank, relative to the checkpoint directory,
    by DeepSpeed's own naming and writer flags: the module file on its data-parallel writer, the ZeRO partition
    named by this rank's data-parallel rank. (Its recovery scripts go to `root`, outside the checkpoint.)"""
    written = []
    if ds_engine.save_non_zero_checkpoint:
        written.append(ds_engine._get_ckpt_name(str(root), tag))
    if ds_engine.save_zero_checkpoint:
        written.append(ds_engine._get_zero_ckpt_name(str(root), tag))
    return [Path(p).relative_to(root / tag).as_posix() for p in written]


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
        written = deepspeed_files(ds_engine, self.root, tmp_tag) + self._write_rank_files(tmp, matrix_engine)
        if self.rank == 0:
            if dense_state is not None:
                save_safetensors(dense_state, tmp / "dense_state.safetensors")
                written.append("dense_state.safetensors")
            if registry:
                flat = flatten_states({name: obj.state_dict() for name, obj in registry.items()})
                save_safetensors(flat, tmp / "registry.safetensors")
                written.append("registry.safetensors")
        mine = {rel: self._describe(tmp / rel) for rel in written}
        files = {rel: info for part in ddist.gather_objects(mine) for rel, info in part.items()}
        if self.rank == 0:
            # A file no rank claimed (a DeepSpeed version writing something new) is still listed and hashed.
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                if f.relative_to(tmp).as_posix() not in files:
                    files[f.relative_to(tmp).as_posix()] = self._describe(f)
            full = {"format_version": FORMAT_VERSION, "tag": tag, "step": step, "world_size": self.world_size,
                    "owners": matrix_engine.owners, "files": files, **manifest}
            write_text_atomic(tmp / MANIFEST, sealed_text(full))
            for folder in sorted({(tmp / rel).parent for rel in files} | {tmp}):
                fsync_dir(folder)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            fsync_dir(self.root)
            write_text_atomic(self.root / "latest", tag)
            self._prune()
        ddist.barrier()
        return final

    def _describe(self, path: Path) -> dict:
        return {"bytes": path.stat().st_size, "sha256": sha256_and_sync(path), "rank": self.rank}

    def _write_rank_files(self, tmp: Path, matrix_engine) -> list[str]:
        rel = [f"backbone/rank{self.rank:05d}.safetensors", f"rng/rank{self.rank:05d}.json"]
        (tmp / "backbone").mkdir(parents=True, exist_ok=True)
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        save_safetensors(flatten_states(matrix_engine.state_dict()), tmp / rel[0])
        (tmp / rel[1]).write_text(json.dumps(rng_state()))
        return rel

    def _prune(self) -> None:
        tags = checkpoint_tags(self.root)
        for old in tags[:-self.keep_last]:
            shutil.rmtree(self.root / old, ignore_errors=True)

    # ---- find and verify -----------------------------------------------------------------------------------

    def find(self, resume: str, wanted: Callable[[str], bool] = lambda rel: True) -> LoadedCheckpoint | None:
        """Collective. `auto`: the newest checkpoint under root that every rank found intact (falling back past
        damaged ones with a warning naming the file), None when root holds no checkpoint, CheckpointError naming
        every damaged file when it holds some and none is intact (starting over would silently drop the run);
        otherwise the checkpoint directory `resume`, refused with CheckpointError naming the file if any rank found
        it damaged. `wanted` limits the digest checks to the files the caller will read (evaluation reads no
        DeepSpeed file)."""
        explicit = resume != "auto"
        paths = [Path(resume)] if explicit else candidates(self.root)
        skipped = []
        for path in paths:
            manifest = None
            try:
                manifest = read_manifest(path)
                errors = verify_digests(path, manifest, self.rank, self.world_size, wanted)
            except CheckpointError as err:
                errors = [str(err)]
            # One collective per candidate: every rank sees every rank's findings, so all take the same branch.
            found = sorted({e for part in ddist.gather_objects(errors) for e in part})
            if not found:
                return LoadedCheckpoint(path, manifest)
            if explicit:
                raise CheckpointError("; ".join(found))
            if self.rank == 0:
                log.warning("resume auto: skipping %s: %s", path, "; ".join(found))
            skipped.extend(found)
        if skipped:
            raise CheckpointError(f"resume auto: no checkpoint under {self.root} is intact: {'; '.join(skipped)}. "
                                  f"Allowed: repair or remove them, or another checkpoint.dir to start a new run")
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
