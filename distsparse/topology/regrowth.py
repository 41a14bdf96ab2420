"""Regrowth into legal patterns, with Motif Pattern Revisitation (MPR).

Paper (seeds/chtsnm_tans_paper.txt) App. E.2: each refreshed row group takes
p* = argmax_{p in R_N} <p, S_g>, S_g its regrowth (CH) scores; block-wise the same over the motif library
(research/cht_topology.md s4c: a [B, 16] x [16, P] matmul). App. E.3, MPR: z_g ~ Bernoulli(rho); when
z_g = 1 the old pattern leaves the candidate set, so rho = 0 is the standard projection and rho = 1 forces
every refreshed unit to change. Defaults (paper s4.5 and App. H.5): rho = 0.5 at row-wise 1:4, 0.75 at
row-wise 2:4, off elsewhere. Option `sample`: Gumbel-max over the legal patterns with probability
proportional to gain + 1e-5 (research s3/s4c, the CHTs soft regrowth; the eps is the lab's fallback that
keeps all-zero gains sampleable). Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

import torch

from distsparse.nm import NMSpec

REGROW_MODES = ("argmax", "sample")
SAMPLE_EPS = 1e-5
_DEFAULT_RHO = {(1, "row"): 0.5, (2, "row"): 0.75}


def default_mpr_rho(spec: NMSpec) -> float:
    """MPR forcing probability of the paper's canonical runs: 0.5 row 1:4, 0.75 row 2:4, 0 otherwise."""
    return _DEFAULT_RHO.get((spec.n, spec.layout), 0.0)


def _draw(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    # Uniforms come from the generator's own device so a CPU generator gives the same draw on any device.
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=gen_device).to(device)


def choose_patterns(unit_scores: torch.Tensor, survivors: torch.Tensor, old_ids: torch.Tensor,
                    library: torch.Tensor, *, rho: float = 0.0, mode: str = "argmax",
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """New library ids (int64 [B]) and MPR exclusions (bool [B]) for B refreshed units.

    unit_scores [B, S] fp32 regrowth scores of each unit's S positions; survivors bool [B, S] links that
    must stay (all False in group/block refresh); old_ids [B] each unit's pattern before the refresh;
    library bool [P, S]. A pattern is a candidate when it contains every survivor and, if the unit's
    Bernoulli(rho) draw excludes it, is not the old pattern. Draws B uniforms (MPR, always, so the stream
    layout does not depend on rho) and, in `sample` mode, B x P more. Ties go to the lowest library id.
    """
    if mode not in REGROW_MODES:
        raise ValueError(f"regrow: got {mode!r}; allowed: {', '.join(REGROW_MODES)}")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"mpr_rho: got {rho}; allowed: 0 <= rho <= 1")
    num_units, device = unit_scores.shape[0], unit_scores.device
    lib = library.float()                                          # [P, S]
    candidate = (survivors.float() @ (1.0 - lib).T) == 0           # [B, P] pattern holds every survivor
    excluded = _draw((num_units,), generator, device) < rho        # z_g ~ Bernoulli(rho); rand < 1 always
    candidate[excluded.nonzero().view(-1), old_ids[excluded]] = False
    # Internal invariant: removing >= 1 link leaves >= 2 completions, so an exclusion never empties a row.
    assert bool(candidate.any(1).all()), "a refreshed unit has no legal candidate pattern"
    gain = unit_scores.float() @ lib.T                             # [B, P] <p, S_g>
    if mode == "sample":
        gumbel = -torch.log(-torch.log(_draw(tuple(gain.shape), generator, device)
                                       .clamp_min_(torch.finfo(torch.float64).tiny)))
        gain = torch.log(gain.double().clamp_min(0.0) + SAMPLE_EPS) + gumbel
    new_ids = gain.masked_fill(~candidate, float("-inf")).argmax(1)   # first maximum on ties
    return new_ids, excluded
