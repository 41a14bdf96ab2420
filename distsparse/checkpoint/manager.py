"""Sharded, atomic checkpoints: save, find (verified, agreed on by every rank) and load, part by part.

What goes in are the parts registered by name (checkpoint/parts.py; the trainer registers run, data, dense,
backbone, registry, rng in that order); save and load walk them in the order registered. Layout of `root/`
(DESIGN decision 6), with the part that writes each file:

    latest                          tag of the newest complete checkpoint, written last (tmp + rename)
    step00000120/
      manifest.json                 rank 0: format, world size, step (the manager); config, tokenizer checksum,
                                    NS coefficients, FFN rounding, batch plan (run); consumed samples (data);
                                    owner map (backbone); every other file with its size, sha256 and the rank
                                    that wrote (and hashed) it; its own digest
      backbone/rank00000.safetensors  backbone, each rank: fp32 master, codes and rule state of its matrices
      dense_state.safetensors       dense, rank 0: the dense side's fp32 masters and Adam moments by parameter
                                    name, so a run can resume on another world size (ZeRO files are per-partition)
      registry.safetensors          registry, rank 0: the method hooks' saved state (e.g. permutations)
      rng/rank00000.json            rng, each rank: python, numpy and torch RNG states
      mp_rank_00_model_states.pt    dense: DeepSpeed, written by its data-parallel writer (rank 0)
      zero_pp_rank_<r>_mp_rank_00_optim_states.pt   dense: DeepSpeed, rank r's ZeRO partition (bf16_ prefix in bf16)

A checkpoint is written under `.tmp-<tag>/`, made durable, then renamed: a crash mid-save leaves the previous
checkpoint as `latest`. Each rank hashes the files it wrote; the digests are gathered into the manifest. Before
anything is loaded, every rank checks the manifest and the file sizes, hashes the files it wrote (manifest.py's
`verifier`), and one collective decides: `resume=auto` falls back past a checkpoint any rank found damaged, an
explicit path is refused; either way the file is named. Project files are safetensors or JSON (no pickle).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable

from distsparse import dist as ddist
from distsparse.checkpoint.files import fsync_dir, sha256_and_sync, write_text_atomic
from distsparse.checkpoint.manifest import (
    FORMAT_VERSION, MANIFEST, CheckpointError, candidates, checkpoint_tags, read_manifest, sealed_text, tag_for,
    verify_digests,
)
from distsparse.checkpoint.parts import LoadedCheckpoint, Part

RESERVED = {"format_version", "tag", "step", "world_size", "files"}   # the manager's own manifest entries

log = logging.getLogger("distsparse")


class CheckpointManager:
    """Owns save, load and atomicity of run checkpoints; what goes in are the parts registered by name
    (checkpoint/parts.py), saved and loaded in one order."""

    def __init__(self, root: str | Path, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last: got {keep_last}; allowed: an integer >= 1")
        self.root, self.keep_last = Path(root), keep_last
        self.rank, self.world_size = ddist.rank(), ddist.world_size()
        self.parts: dict[str, Part] = {}

    def register(self, **parts: Part) -> None:
        """Add parts by name, after those registered before: save writes and load reads them in this order."""
        taken = self.parts.keys() & parts.keys()
        assert not taken, f"checkpoint parts registered twice: {sorted(taken)}"
        self.parts.update(parts)

    # ---- save ----------------------------------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Collective: every rank calls it. Every part writes its files into a temporary folder, renamed to the
        final checkpoint directory once the manifest is written; returns that directory."""
        tag = tag_for(step)
        tmp, final = self.root / f".tmp-{tag}", self.root / tag
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        ddist.barrier()
        written, entries = [], {}
        for part in self.parts.values():
            written += part.save(tmp)
            kept = part.manifest()
            assert not kept.keys() & (entries.keys() | RESERVED), f"manifest entries written twice: {sorted(kept)}"
            entries.update(kept)
        mine = {rel: self._describe(tmp / rel) for rel in written}
        files = {rel: info for part in ddist.gather_objects(mine) for rel, info in part.items()}
        if self.rank == 0:
            # A file no rank claimed (a DeepSpeed version writing something new) is still listed and hashed.
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                if f.relative_to(tmp).as_posix() not in files:
                    files[f.relative_to(tmp).as_posix()] = self._describe(f)
            full = {"format_version": FORMAT_VERSION, "tag": tag, "step": step, "world_size": self.world_size,
                    **entries, "files": files}
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

    def load(self, ckpt: LoadedCheckpoint) -> None:
        """Collective: every registered part reads back what it saved, in the order it was saved (a part that
        refuses the checkpoint, as the run's does for another model, comes before any state is read)."""
        for part in self.parts.values():
            part.load(ckpt)
