"""The seven LLaMA projections of a decoder layer that make up the backbone, in forward order (attention q, k, v,
o; MLP gate, up, down). Their leaf names pick the backbone out of a model (distsparse.models), order gradients
in backward (distsparse.optim.grad_buckets) and index per-layer-type statistics (distsparse.train)."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
