"""LLaMA models with sparse backbones."""

from distsparse.models.build import PROJECTIONS, build_model, llama_config, parameter_counts, projection_names, sparsify

__all__ = ["PROJECTIONS", "build_model", "llama_config", "parameter_counts", "projection_names", "sparsify"]
