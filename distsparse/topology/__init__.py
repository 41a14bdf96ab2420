"""CHTs topology learning for N:M masks: CH scores, soft-magnitude selection, legal regrowth with MPR,
the zeta/temperature schedules and the per-matrix refresh. Pure tensor functions (DESIGN s3)."""

from distsparse.topology.refresh import (
    NEW_WEIGHT_INITS, ROWWISE_SELECTIONS, RefreshParams, RefreshResult, check_legal, refresh_generator,
    refresh_matrix,
)
from distsparse.topology.regrowth import REGROW_MODES, choose_patterns, default_mpr_rho
from distsparse.topology.schedule import is_refresh_step, t_end_for, temperature_at, zeta_at
from distsparse.topology.scores import SCORE_VARIANTS, ch_scores
from distsparse.topology.selection import SELECTION_MODES, select_units, selection_count

__all__ = [
    "NEW_WEIGHT_INITS", "REGROW_MODES", "ROWWISE_SELECTIONS", "RefreshParams", "RefreshResult",
    "SCORE_VARIANTS", "SELECTION_MODES", "ch_scores", "check_legal", "choose_patterns", "default_mpr_rho",
    "is_refresh_step", "refresh_generator", "refresh_matrix", "select_units", "selection_count", "t_end_for",
    "temperature_at", "zeta_at",
]
