"""Optimizer state across a topology refresh (DESIGN decision 11; paper App. I.3).

A refresh changes a matrix's pattern, hence the order of its compressed values. Given the slot map of
distsparse.nm.slot_map (new slot -> old slot or -1), the fp32 master and every slot tensor of the rule's state
(V and P for TANS, the Adam moments, Muon's momentum) follow their link to its new slot; -1 slots (regrown
links) start at zero weight and zero state. A link removed and re-selected in the same refresh survives the slot
map, so it keeps weight and state. Counters: `tau` (TANS refresh age) restarts at 0 in every mode.

Reset modes (paper Table A8):
  changed  only -1 slots get zero state (default; the paper's best with ramp 8)
  all      every slot tensor is zeroed and the `step` counter restarts (the weights still move)
  none     regrown coordinates get back the state they had when last active, from a dense shadow

The shadow (mode `none`, ablation runs only) is one dense fp32 [out, in] tensor per slot key: 4 * out * in
bytes each, 8 * out * in for TANS (V, P): 4x the compressed V + P at 1:4 and 2x at 2:4, per owned matrix.
Protocol per refresh: `update_shadow(shadow, old_index, state)` with the old pattern's index, then
`move_state(..., reset_mode="none", shadow=shadow, new_index=new_index)`.
Pure tensor functions: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

import torch

from distsparse.nm import move_slots

RESET_MODES = ("changed", "all", "none")


def check_reset_mode(reset_mode: str) -> None:
    """Refuse a reset mode not in RESET_MODES, naming it (the engine at construction, move_state on each call)."""
    if reset_mode not in RESET_MODES:
        raise ValueError(f"reset_mode: got {reset_mode!r}; allowed: {', '.join(RESET_MODES)}")


def init_shadow(state: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Zero dense [out, in] fp32 shadows of every slot tensor of `state` (every key but the 0-dim counters)."""
    return {key: torch.zeros(shape, dtype=torch.float32, device=t.device)
            for key, t in state.items() if t.dim() > 0}


def update_shadow(shadow: dict[str, torch.Tensor], old_index: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    """Record the current state of every active link at its (row, col); call before `move_state`.

    Links that stay active are overwritten at the next refresh, so after it the shadow holds, for every
    inactive position, its state at the moment it left.
    """
    for key, dense in shadow.items():
        dense.view(-1).index_copy_(0, old_index, state[key].reshape(-1))


def move_state(state: dict[str, torch.Tensor], master: torch.Tensor, slots: torch.Tensor,
               reset_mode: str = "changed", shadow: dict[str, torch.Tensor] | None = None,
               new_index: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(master, state) re-laid out for the new pattern; new tensors, the inputs are not modified.

    `slots` int64 [out * k]: new slot -> old slot or -1. Mode `none` also needs `shadow` (see `update_shadow`)
    and `new_index`, the new pattern's flat kept index.
    """
    check_reset_mode(reset_mode)
    if reset_mode == "none" and (shadow is None or new_index is None):
        raise ValueError("reset_mode: 'none' needs the dense shadow of the state and the new kept index "
                         f"(got shadow={'set' if shadow is not None else None}, "
                         f"new_index={'set' if new_index is not None else None})")
    new_state: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if t.dim() == 0:
            restart = key == "tau" or (key == "step" and reset_mode == "all")
            new_state[key] = torch.zeros_like(t) if restart else t.clone()
        else:
            assert t.shape == master.shape, (key, tuple(t.shape), tuple(master.shape))
            new_state[key] = torch.zeros_like(t) if reset_mode == "all" else move_slots(t, slots)
    if reset_mode == "none":
        regrown = (slots < 0).nonzero().view(-1)
        positions = new_index.index_select(0, regrown)
        for key, dense in shadow.items():
            new_state[key].view(-1).index_copy_(0, regrown, dense.view(-1).index_select(0, positions))
    return move_slots(master, slots), new_state
