"""Small helpers shared across packages."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def hash_seed(text: str) -> int:
    """The one derivation of a seed from a string: the first 8 bytes of its sha256, as a 63-bit integer, identical
    across processes, ranks and Python versions (Python's hash() is salted per process)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (ints, names): the parts joined by "|"."""
    return hash_seed("|".join(map(str, parts)))


def flatten_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as one level of dotted keys ("train.lr"); an empty dict stays a value, so a section
    without settings is still a key that can differ."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


ABSENT = "<absent>"   # the value of a key one config lacks


def config_differences(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """The dotted keys whose values differ between two nested configs, sorted, with (old value, new value); a key
    one side lacks has ABSENT there, so it differs even from a None on the other side."""
    old_flat, new_flat = flatten_config(old), flatten_config(new)
    differences = {}
    for key in sorted(old_flat.keys() | new_flat.keys()):
        values = old_flat.get(key, ABSENT), new_flat.get(key, ABSENT)
        if values[0] != values[1]:
            differences[key] = values
    return differences


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set | None = None) -> int:
    """Bytes of the storages behind `tensors` (an iterable; None entries skipped) not already in `seen`, which
    this adds them to: views and aliases count once, across calls that share `seen` (DESIGN s6). Meta tensors hold
    no bytes."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
