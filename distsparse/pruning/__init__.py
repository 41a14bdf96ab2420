"""One-shot N:M pruning of pretrained LLaMA checkpoints: magnitude, Wanda and SparseGPT, with an optional fixed
random or learned (ShuffleSparse Algorithm 1) input permutation per group of projections. Entry point:
`prune_model`; the command-line tool is tools/prune_oneshot.py."""

from distsparse.pruning.calibration import (
    INPUT_GROUPS, METHODS, PERMUTATIONS, PruneConfig, PruneResult, capture_layer_inputs, check_model, prune_linear,
    prune_model,
)
from distsparse.pruning.learned_permutation import PermutationConfig, inverse_permutation
from distsparse.pruning.sparsegpt import HessianStats, sparsegpt_prune
from distsparse.pruning.wanda import ColumnNormStats, magnitude_scores, prune_by_scores, wanda_scores

__all__ = [
    "INPUT_GROUPS", "METHODS", "PERMUTATIONS", "ColumnNormStats", "HessianStats", "PermutationConfig",
    "PruneConfig", "PruneResult", "capture_layer_inputs", "check_model", "inverse_permutation",
    "magnitude_scores", "prune_by_scores", "prune_linear", "prune_model", "sparsegpt_prune", "wanda_scores",
]
