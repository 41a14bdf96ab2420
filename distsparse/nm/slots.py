"""Slot maps: where each kept value of a new topology was stored in the old one (DESIGN decision 11)."""

from __future__ import annotations

import torch

from distsparse.nm.storage import NMMeta, kept_index


def slot_map(old: NMMeta, new: NMMeta) -> torch.Tensor:
    """int64 [out * k]: for every slot of `new`, the slot of `old` holding the same (row, col), or -1.

    Both flat kept indices are globally ascending (row-major, columns ascending), so one searchsorted
    finds every surviving link.
    """
    assert old.shape == new.shape and old.spec == new.spec, (old.shape, new.shape, old.spec, new.spec)
    old_index, new_index = kept_index(old), kept_index(new)
    pos = torch.searchsorted(old_index, new_index).clamp_(max=old_index.numel() - 1)
    return torch.where(old_index[pos] == new_index, pos, torch.full_like(pos, -1))


def move_slots(tensor: torch.Tensor, slots: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Values [out, k] re-laid out by a slot map: kept links follow it, new slots get `fill`."""
    flat = tensor.reshape(-1)
    moved = torch.where(slots >= 0, flat[slots.clamp(min=0)], torch.full_like(flat, fill))
    return moved.view_as(tensor)
