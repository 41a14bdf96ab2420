"""One topology refresh of one compressed matrix: select, clear, score, regrow with MPR, move values.

DESIGN s5 (row-wise and block-wise refresh) and decision 11; paper s3.4, App. E, H.4; research/cht_topology.md
s1b (scores), s2 (selection, zeta), s4c (block-level refresh), s7 (new links start at zero; SWI option).

    zeta_t, T     = schedule(step, T_end)
    units         = round(zeta_t * U) units drawn by soft magnitude (keep prob ~ mean|w|^T), or hard
                    (row-wise `link_survivors`: round(zeta_t * links) links instead; a unit is every group
                    that lost a link, and its survivors stay)
    mask         <- mask with the selected units (links) cleared
    S             = CH2-L3n (or CH3-L3n) scores of the cleared mask
    each unit     = argmax over its candidate patterns of <p, S_g>, old pattern excluded with prob rho (MPR)
    values        follow their link (slot map); a link removed and reselected is kept; new links 0 (or SWI)

Randomness comes only from `generator`; `refresh_generator(seed, step, name)` derives it from a stable hash,
so a refresh needs no RNG state in checkpoints and gives the same result whichever rank computes it.
Draw order: selection (U or links uniforms, soft only), MPR (B uniforms), regrow sampling (B x P, `sample`
only), SWI normals (one per new link, `swi` only). Pure tensor functions: no distributed code, no config
objects, no logging; the trainer logs `stats` and the engine moves optimizer state with `slots`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from distsparse.nm import NMMeta, decode, encode, is_legal, kept_index, move_slots, slot_map
from distsparse.topology.regrowth import REGROW_MODES, choose_patterns, default_mpr_rho
from distsparse.topology.schedule import temperature_at, zeta_at
from distsparse.topology.scores import SCORE_VARIANTS, ch_scores
from distsparse.topology.selection import SELECTION_MODES, select_units, selection_count
from distsparse.topology.units import (
    M, gather_units, library, num_units, pattern_ids, scatter_units, unit_magnitude,
)
from distsparse.utils import hash_seed

ROWWISE_SELECTIONS = ("group_full", "link_survivors")
NEW_WEIGHT_INITS = ("zero", "swi")


def _allowed(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: got {value!r}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class RefreshParams:
    """How a refresh behaves (the topology section of a method config maps onto these fields)."""
    zeta0: float = 0.1                       # refresh fraction at step 0; cosine-annealed to 0 at T_end
    temperature_start: float = 1.0           # soft-selection exponent T, linear start -> end over T_end
    temperature_end: float = 9.0
    selection: str = "soft"                  # soft | hard
    rowwise_selection: str = "group_full"    # group_full | link_survivors (row-wise layout only)
    score: str = "ch2"                       # ch2 | ch3 (L3n, node-based)
    regrow: str = "argmax"                   # argmax (paper App. E.2) | sample
    mpr_rho: float | None = None             # None: default_mpr_rho(spec)
    chunk_size: int = 512                    # rows / columns per score chunk
    new_weight_init: str = "zero"            # zero | swi (N(0, 2 / (density * fan_in)))

    def __post_init__(self) -> None:
        if not 0.0 < self.zeta0 <= 1.0:
            raise ValueError(f"zeta0: got {self.zeta0}; allowed: 0 < zeta0 <= 1")
        for key in ("temperature_start", "temperature_end"):
            if not getattr(self, key) > 0.0:
                raise ValueError(f"{key}: got {getattr(self, key)}; allowed: a number > 0")
        _allowed("selection", self.selection, SELECTION_MODES)
        _allowed("rowwise_selection", self.rowwise_selection, ROWWISE_SELECTIONS)
        _allowed("score", self.score, SCORE_VARIANTS)
        _allowed("regrow", self.regrow, REGROW_MODES)
        _allowed("new_weight_init", self.new_weight_init, NEW_WEIGHT_INITS)
        if self.mpr_rho is not None and not 0.0 <= self.mpr_rho <= 1.0:
            raise ValueError(f"mpr_rho: got {self.mpr_rho}; allowed: null (paper default) or 0 <= rho <= 1")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size: got {self.chunk_size}; allowed: an integer >= 1")


@dataclass
class RefreshResult:
    """New topology, the slot map (new slot -> old slot or -1) for state that follows its link, the moved
    values, and float statistics: zeta, temperature, groups_selected, groups_changed (pattern actually
    changed), mpr_exclusions, links_changed (new links = removed links)."""
    meta: NMMeta
    slots: torch.Tensor
    new_values: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


def refresh_generator(seed: int, step: int, name: str) -> torch.Generator:
    """A CPU generator seeded by `hash_seed` of (seed, step, name) as a JSON list: reproducible, independent of
    world size. (JSON, not stable_seed's "|" join: the draws of earlier runs stay pinned.)"""
    return torch.Generator().manual_seed(hash_seed(json.dumps([int(seed), int(step), str(name)])))


def check_legal(meta: NMMeta, name: str) -> None:
    """Raise RuntimeError naming the matrix when its codes are not a legal pattern (stop the run loudly)."""
    if not is_legal(meta):
        raise RuntimeError(f"topology refresh left {name!r} with an illegal {meta.spec} mask "
                           f"(shape {tuple(meta.shape)}, codes {tuple(meta.codes.shape)} {meta.codes.dtype})")


def _select(weights: torch.Tensor, meta: NMMeta, mask: torch.Tensor, zeta: float, temperature: float,
            params: RefreshParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select and clear (in `mask`) the refreshed units: (unit ids [B] ascending, old bits, survivor bits)."""
    spec = meta.spec
    if spec.layout == "row" and params.rowwise_selection == "link_survivors":
        links = weights.abs().reshape(-1)
        removed = select_units(links, selection_count(zeta, links.numel()), temperature=temperature,
                               mode=params.selection, generator=generator)
        flat = kept_index(meta)[removed]
        units = torch.unique(flat // M)          # flat = r*I + c, so flat // 4 = r*I/4 + c//4 = group id
        old_bits = gather_units(mask, units, spec)
        mask.view(-1)[flat] = False
        return units, old_bits, gather_units(mask, units, spec)
    units = select_units(unit_magnitude(weights, spec, meta.shape),
                         selection_count(zeta, num_units(spec, meta.shape)), temperature=temperature,
                         mode=params.selection, generator=generator)
    old_bits = gather_units(mask, units, spec)
    scatter_units(mask, units, spec, False)
    return units, old_bits, torch.zeros_like(old_bits)


def _install(meta: NMMeta, mask: torch.Tensor, units: torch.Tensor, new_ids: torch.Tensor) -> NMMeta:
    """The refreshed metadata: block codes are motif ids, so only the refreshed bytes change; row codes
    are packed positions, so the refreshed groups are written into the cleared mask and re-encoded."""
    spec = meta.spec
    if spec.layout == "block":
        codes = meta.codes.clone()
        codes.view(-1)[units] = new_ids.to(codes.dtype)
        return NMMeta(codes, spec, meta.shape)
    scatter_units(mask, units, spec, library(spec, device=mask.device)[new_ids])
    return encode(mask, spec)


@torch.no_grad()
def refresh_matrix(weights: torch.Tensor, meta: NMMeta, *, step: int, t_end: int, params: RefreshParams,
                   generator: torch.Generator) -> RefreshResult:
    """Refresh one matrix: weights fp32 [O, K] (NMSparseLinear values layout), meta its codes; 0 <= step <=
    t_end (masks are frozen after T_end, schedule.is_refresh_step says when to call)."""
    spec, (out_f, in_f) = meta.spec, meta.shape
    if tuple(weights.shape) != (out_f, meta.kept_per_row):
        raise ValueError(f"weights: got shape {tuple(weights.shape)}; allowed: {(out_f, meta.kept_per_row)} "
                         f"for a {spec} matrix of shape {meta.shape}")
    if not 0 <= step <= t_end:
        raise ValueError(f"step: got {step} with t_end={t_end}; allowed: 0 <= step <= t_end (frozen after)")
    if spec.layout == "block" and params.rowwise_selection != "group_full":
        raise ValueError(f"rowwise_selection: got {params.rowwise_selection!r} for a block-wise matrix; "
                         f"allowed: group_full (block-wise refresh is block-level, research s4c)")
    zeta = zeta_at(step, t_end, params.zeta0)
    temperature = temperature_at(step, t_end, params.temperature_start, params.temperature_end)
    rho = default_mpr_rho(spec) if params.mpr_rho is None else params.mpr_rho

    mask = decode(meta)
    units, old_bits, survivors = _select(weights, meta, mask, zeta, temperature, params, generator)
    old_ids = pattern_ids(old_bits, spec)
    if units.numel():
        scores = ch_scores(mask, params.score, params.chunk_size)
        new_ids, excluded = choose_patterns(gather_units(scores, units, spec), survivors, old_ids,
                                            library(spec, device=mask.device), rho=rho, mode=params.regrow,
                                            generator=generator)
        del scores      # the [O, I] fp32 buffer is not needed for the slot map and value move
    else:
        new_ids, excluded = old_ids, torch.zeros_like(old_ids, dtype=torch.bool)
    new_meta = _install(meta, mask, units, new_ids)
    slots = slot_map(meta, new_meta)
    fresh = slots < 0
    new_values = move_slots(weights, slots)
    if params.new_weight_init == "swi":
        std = math.sqrt(2.0 / (spec.density * in_f))
        draw = torch.randn(int(fresh.sum()), generator=generator, dtype=weights.dtype, device=generator.device)
        new_values.view(-1)[fresh] = draw.to(weights.device) * std
    stats = {
        "zeta": zeta,
        "temperature": temperature,
        "groups_selected": float(units.numel()),
        "groups_changed": float((new_ids != old_ids).sum()),
        "mpr_exclusions": float(excluded.sum()),
        "links_changed": float(fresh.sum()),
    }
    return RefreshResult(new_meta, slots, new_values, stats)
