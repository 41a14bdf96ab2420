"""When and how the run refreshes its masks: maps the method's topology config onto the pure refresh of
distsparse.topology and aggregates refresh statistics per layer type for TensorBoard (DESIGN s5, decision 5)."""

from __future__ import annotations

import torch

from distsparse import dist as ddist
from distsparse.config import TopologyConfig
from distsparse.layers.llama_projections import PROJECTIONS
from distsparse.nm import NMMeta
from distsparse.optim.engine import RefreshFn
from distsparse.topology import (
    RefreshResult, check_legal, is_refresh_step, refresh_generator, refresh_matrix, t_end_for,
)

# links_off_origin / links_kept: kept positions the step-0 topology did not hold (MatrixEngine._refresh, origin.py)
STAT_KEYS = ("groups_selected", "groups_changed", "mpr_exclusions", "links_changed", "links_off_origin", "links_kept")


class TopologyPolicy:
    def __init__(self, cfg: TopologyConfig, total_steps: int, seed: int):
        self.cfg, self.seed = cfg, seed
        self.params = cfg.params
        self.t_end = t_end_for(total_steps, cfg.t_end_fraction)

    def due(self, step: int) -> bool:
        """`step` = optimizer steps completed, counting the one being taken."""
        return self.cfg.enabled and is_refresh_step(step, self.cfg.update_interval, self.t_end)

    def refresh_fn(self, step: int) -> RefreshFn:
        def refresh(name: str, master: torch.Tensor, meta: NMMeta) -> RefreshResult:
            # Seeded by (seed, step, name): the same masks whichever rank owns the matrix.
            result = refresh_matrix(master, meta, step=step, t_end=self.t_end, params=self.params,
                                    generator=refresh_generator(self.seed, step, name))
            check_legal(result.meta, name)
            return result
        return refresh


def refresh_metrics(stats: dict[str, dict], seconds: float) -> dict[str, float]:
    """Per layer type sums over every rank's owned matrices (links_ever_changed: the share of the type's kept
    positions that its step-0 topology did not hold); zeta and T averaged over the ranks that refreshed a
    matrix of that type (each rank reports them once per type: they are the same on every matrix of a step). One
    all-reduce of a fixed-order vector, one max of the seconds."""
    # Host-side bookkeeping (the stats are Python floats); dist_sum moves it to the collectives' device.
    vec = torch.zeros(len(PROJECTIONS), len(STAT_KEYS) + 3, dtype=torch.float64, device="cpu")
    for name, s in stats.items():
        row = PROJECTIONS.index(name.rsplit(".", 1)[-1])
        for j, key in enumerate(STAT_KEYS):
            vec[row, j] += s.get(key, 0.0)
        vec[row, -3:] = torch.tensor([s["zeta"], s["temperature"], 1.0], dtype=torch.float64, device="cpu")
    vec = ddist.dist_sum(vec)
    out = {"topology/refresh_s": ddist.dist_max(seconds)}
    for i, proj in enumerate(PROJECTIONS):
        sel, ranks = vec[i, 0], vec[i, -1]
        if sel == 0:
            continue
        out[f"topology/{proj}/groups_selected"] = float(sel)
        out[f"topology/{proj}/effective_refresh_rate"] = float(vec[i, 1] / sel)
        out[f"topology/{proj}/mpr_exclusions"] = float(vec[i, 2])
        out[f"topology/{proj}/links_changed"] = float(vec[i, 3])
        if vec[i, 5] > 0:
            out[f"topology/{proj}/links_ever_changed"] = float(vec[i, 4] / vec[i, 5])
        out["topology/zeta"] = float(vec[i, -3] / ranks)
        out["topology/temperature"] = float(vec[i, -2] / ranks)
    return out
