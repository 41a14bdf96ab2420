"""Registry of the per-matrix update rules (DESIGN decision 10) and their state layout.

Every step function has the signature
    step(master [out, k], grad [out, k], state, *, lr, hp, index, shape) -> None
updating master and state in place (fp32), with `index` the flat kept index (distsparse.nm.kept_index) or
None for a dense matrix ([out, in], mask of ones), `shape` = (out, in) of the dense frame and `lr` the
scheduled learning rate. A rule that needs more declares it: `needs_support_mask` rules (`adams`) also take
`mask=` (bool [out, in], the module's current N:M support; dense latents only), which the engine passes.

State: `slot_keys` are fp32 tensors shaped like the master (they move with their link on a refresh,
matrix_state.py); `counter_keys` are 0-dim int64 CPU tensors (read without a device sync).
Pure tensor functions: no distributed code, no config objects, no logging.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from distsparse.optim.hparams import AdamHParams, AdamSHParams, MuonHParams, TansHParams
from distsparse.optim.rules_adam import step_adam, step_adams, step_adamw
from distsparse.optim.rules_muon import step_muon
from distsparse.optim.rules_tans import step_tans


class Rule(NamedTuple):
    step: Callable[..., None]
    hparams: type
    slot_keys: tuple[str, ...]
    counter_keys: tuple[str, ...]
    needs_support_mask: bool = False   # step takes mask= (bool [out, in]): the support it decays the complement of
    newton_schulz: bool = False        # runs Newton-Schulz on the dense frame: its cost is NS FLOPs (owners.py)

    @property
    def state_keys(self) -> tuple[str, ...]:
        return self.slot_keys + self.counter_keys


RULES: dict[str, Rule] = {
    "adam": Rule(step_adam, AdamHParams, ("exp_avg", "exp_avg_sq"), ("step",)),
    "adamw": Rule(step_adamw, AdamHParams, ("exp_avg", "exp_avg_sq"), ("step",)),
    "adams": Rule(step_adams, AdamSHParams, ("exp_avg", "exp_avg_sq"), ("step",), needs_support_mask=True),
    "muon": Rule(step_muon, MuonHParams, ("momentum",), (), newton_schulz=True),
    "tans": Rule(step_tans, TansHParams, ("V", "P"), ("tau", "step"), newton_schulz=True),
}


def get_rule(name: str) -> Rule:
    if name not in RULES:
        raise ValueError(f"rule: got {name!r}; allowed: {', '.join(RULES)}")
    return RULES[name]


def init_state(rule: str, shape: tuple[int, ...], device: torch.device | str | None = None
               ) -> dict[str, torch.Tensor]:
    """Fresh state of `rule` for a master of `shape`: zero fp32 slot tensors on `device`, zero CPU counters."""
    spec = get_rule(rule)
    state = {key: torch.zeros(shape, dtype=torch.float32, device=device) for key in spec.slot_keys}
    state.update({key: torch.zeros((), dtype=torch.int64) for key in spec.counter_keys})
    return state



def step_each(rule: str, masters: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
              states: dict[str, dict[str, torch.Tensor]], *, lr: float, hp, indices: dict[str, torch.Tensor | None],
              shapes: dict[str, tuple[int, int]], masks: dict[str, torch.Tensor] | None = None) -> None:
    """The per-matrix reference: `rule`'s step on each named matrix in turn, one matrix at a time (the oracle the
    matrix engine's group kernels, distsparse/optim/group_rules.py, are checked against). `masks` only for rules
    that need the support."""
    spec = get_rule(rule)
    for name, master in masters.items():
        extra = {"mask": masks[name]} if spec.needs_support_mask else {}
        spec.step(master, grads[name], states[name], lr=lr, hp=hp, index=indices[name], shape=shapes[name], **extra)
