"""LLaMA models with sparse backbones."""

from distsparse.models.build import (
    backbone_modules, backbone_param, branch_rank, build_model, build_on_meta, llama_config,
    parameter_counts, projection_names, sparsify,
)

__all__ = ["backbone_modules", "backbone_param", "branch_rank", "build_model", "build_on_meta",
           "llama_config", "parameter_counts", "projection_names", "sparsify"]
