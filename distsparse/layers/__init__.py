"""Sparse layers: `NMSparseLinear` and (later) permutations, auxiliary branches and dense-latent baselines."""

from distsparse.layers.nm_linear import NMLinearFunction, NMSparseLinear

__all__ = ["NMLinearFunction", "NMSparseLinear"]
