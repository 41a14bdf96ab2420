"""The parts of a run checkpoint, registered by name with CheckpointManager (torchtitan's checkpointer `states`):
save and load walk the same list, so what a checkpoint holds is read back part by part, in the order written.

A part writes this rank's files into the checkpoint folder (returning their paths relative to it), names the
manifest entries it keeps, and loads both back. Both may be collective: every rank walks the same list.

    BackbonePart   the matrix engine: backbone/rankNNNNN.safetensors per rank and the owner map; loads by name
    RegistryPart   the method hooks' saved state (rank 0), read by export and consolidation (checkpoint/model.py);
                   a resume gets these modules back with the rest of the model, from DeepSpeed's module file
    RngPart        this rank's generators; restored on the same world size only
The dense side's part is DeepSpeed's (distsparse/train/deepspeed/checkpoint.py), the run's and the data position's
are the trainer's (distsparse/train/run_state.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from distsparse import dist as ddist
from distsparse.checkpoint.files import (
    SEP, flatten_states, rng_state, save_safetensors, set_rng_state, unflatten_states,
)
from distsparse.checkpoint.manifest import CheckpointError

DENSE_STATE = "dense_state.safetensors"   # the dense side's masters and moments by parameter name (rank 0)
REGISTRY = "registry.safetensors"


@dataclass
class LoadedCheckpoint:
    path: Path
    manifest: dict


class Part:
    """One part of a run checkpoint; the defaults write, keep and load nothing."""

    def manifest(self) -> dict:
        """Entries this part keeps in the manifest (rank 0's are written)."""
        return {}

    def save(self, folder: Path) -> list[str]:
        """Write this rank's files under `folder`; their paths relative to it."""
        return []

    def load(self, ckpt: LoadedCheckpoint) -> None:
        """Read back what `save` wrote and `manifest` kept."""


def load_tensors(ckpt: LoadedCheckpoint, rel: str) -> dict[str, torch.Tensor]:
    with safe_open(str(ckpt.path / rel), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_backbone(ckpt: LoadedCheckpoint, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
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


class BackbonePart(Part):
    """The matrix engine's state: each rank the matrices it owns, keyed by name, so a resume on another world size
    (other owners) loads by name."""

    def __init__(self, matrix):
        self.matrix = matrix

    def manifest(self) -> dict:
        return {"owners": self.matrix.owners}

    def save(self, folder: Path) -> list[str]:
        rel = f"backbone/rank{ddist.rank():05d}.safetensors"
        (folder / "backbone").mkdir(parents=True, exist_ok=True)
        save_safetensors(flatten_states(self.matrix.state_dict()), folder / rel)
        return [rel]

    def load(self, ckpt: LoadedCheckpoint) -> None:
        self.matrix.load_state_dict(load_backbone(ckpt, list(self.matrix.masters)))


class RegistryPart(Part):
    """Modules whose state export and consolidation read from project files alone (`saved_state`: named modules,
    asked at each save). Nothing to load on resume: they are part of the model DeepSpeed's module file restores."""

    def __init__(self, saved_state: Callable[[], dict[str, nn.Module]]):
        self.saved_state = saved_state

    def save(self, folder: Path) -> list[str]:
        modules = self.saved_state()
        if ddist.rank() != 0 or not modules:
            return []
        save_safetensors(flatten_states({name: m.state_dict() for name, m in modules.items()}), folder / REGISTRY)
        return [REGISTRY]


class RngPart(Part):
    """This rank's python, numpy, torch (and CUDA) generators, as JSON; a resume on another world size keeps the
    fresh ones (the ranks are other processes)."""

    def _rel(self) -> str:
        return f"rng/rank{ddist.rank():05d}.json"

    def save(self, folder: Path) -> list[str]:
        (folder / "rng").mkdir(parents=True, exist_ok=True)
        (folder / self._rel()).write_text(json.dumps(rng_state()))
        return [self._rel()]

    def load(self, ckpt: LoadedCheckpoint) -> None:
        path = ckpt.path / self._rel()
        if ckpt.manifest["world_size"] == ddist.world_size() and path.exists():
            set_rng_state(json.loads(path.read_text()))
