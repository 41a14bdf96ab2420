"""Causal SDPA for training without transformers' mask preparation, which reads the device every forward
(issue 25 item 3).

transformers 5's `create_causal_mask`, given no attention mask and no cache (training), checks `position_ids` for a
packed-sequence layout (`masking_utils.find_packed_sequence_indices`: `(...).all()` in Python): one host sync per
forward, before any kernel of the model is queued. For an attention implementation without a registered mask
function it skips the preparation (`_preprocess_mask_arguments`: "custom attention without equivalent mask
creation"). Registering transformers' own `sdpa_attention_forward` under another name gives exactly that: the same
kernel call with `attention_mask=None`, so `is_causal=True` (as `sdpa` gets today, where the prepared mask is None
for unpadded batches: plain `arange` positions, no packed-sequence mask). The trainer feeds neither padding nor
position ids, so the attention is the same; tests/test_host_sync.py checks the logits are equal. A model switched
here refuses an `attention_mask` or `position_ids` (it would ignore them: padding or packed sequences).
"""

from __future__ import annotations

import torch

NAME = "distsparse_causal_sdpa"


def use_causal_sdpa(model: torch.nn.Module) -> None:
    """Switch an `sdpa` transformers model to the mask-free causal SDPA (module docstring); others are left alone."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(NAME, sdpa_attention_forward)
    model.config._attn_implementation = NAME
    model.register_forward_pre_hook(_refuse_masks, with_kwargs=True)


def _refuse_masks(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    given = [key for key in ("attention_mask", "position_ids") if kwargs.get(key) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: got a tensor; allowed: None with the mask-free causal attention "
                         f"{NAME!r} (every sequence causal from position 0, no padding); build the model without "
                         f"distsparse.models.causal_attention.use_causal_sdpa to pass masks")
