"""File-level helpers of checkpoints and exports: digests, durable and atomic writes, safetensors with the
user's file mode, the flat key layout of per-matrix states, and RNG states as JSON (no pickle anywhere).
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

SEP = "::"   # flat safetensors key: "<matrix name>::<state key>"


def sha256_and_sync(path: Path) -> str:
    """sha256 of a file this process wrote, and the file made durable (fsync) while it is open anyway."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def process_umask() -> int:
    """The umask, read from /proc on Linux; elsewhere set and restored, which briefly changes it for every thread
    of the process (a file another thread creates in that instant gets 0o077's mode: never more permissive)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def default_file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the process umask."""
    return 0o666 & ~process_umask()


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, then the mode a plain `open()` would give: safetensors creates its files 0600,
    which hides checkpoints and exports from the user's group whatever their umask says."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, default_file_mode())


def flatten_states(states: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{name}{SEP}{key}": t.detach().contiguous().cpu() for name, s in states.items() for key, t in s.items()}


def unflatten_states(flat: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, _, sub = key.rpartition(SEP)
        out.setdefault(name, {})[sub] = t
    return out


def rng_state() -> dict:
    """This rank's generators. The CUDA one (the current device's) only once CUDA is initialized: asking for it
    earlier would initialize CUDA, and before that it has drawn nothing."""
    np_state = np.random.get_state()
    state = {"python": repr(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` saved; a CUDA state saved on a GPU and resumed without one is dropped (nothing
    there draws from a CUDA generator)."""
    random.setstate(ast.literal_eval(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
