"""How far a matrix's topology has moved from the one it started with (issue 28 item 2).

`topology/{projection}/links_ever_changed` = the share of a type's active links (kept positions) that the step-0
topology did not hold. The exact state for it is the step-0 codes themselves (the cheapest exact one: any per-link
flag that follows its link cannot tell a regrown link at a step-0 position from a new one): the same packed uint8
codes the layer holds, 2 bits per kept value row-wise (kept / 4 bytes) and 1 byte per 4x4 block block-wise, kept by
the matrix's owner only (MatrixEngine.origin_codes) and saved with its checkpoint state by name, so it survives an
elastic resume. At 1b 1:4 row-wise that is the layers' codes once over the world (memory_estimate's
`origin_codes`).
Pure tensor functions: no distributed code.
"""

from __future__ import annotations

import torch

from distsparse.nm import NMMeta, decode, kept_index


def links_off_origin(meta: NMMeta, origin_codes: torch.Tensor) -> torch.Tensor:
    """Number of kept positions of `meta` that the pattern `origin_codes` (same spec and shape) does not keep: an
    int64 0-dim tensor on the codes' device (no host read)."""
    if origin_codes.shape != meta.codes.shape:
        raise ValueError(f"origin codes: got shape {tuple(origin_codes.shape)}; allowed: the matrix's codes shape "
                         f"{tuple(meta.codes.shape)}")
    origin = decode(NMMeta(origin_codes.to(meta.codes.device), meta.spec, meta.shape)).view(-1)
    return (~origin.index_select(0, kept_index(meta))).sum()
