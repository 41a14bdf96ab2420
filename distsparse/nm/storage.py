"""Compressed N:M storage: kept values plus packed index metadata (DESIGN s3).

Shapes (W is [out, in], k = in * N / 4 kept values per output row):
  values  [out, k]          kept weights of each row in column order (same for both layouts, since a
                            transposable block also keeps N per row)
  codes   row-wise:   uint8 [out, ceil(k / 4)]  2-bit position inside its group of each kept value,
                            four per byte, first value in the low bits (NVIDIA's 2:4 convention)
          block-wise: uint8 [out / 4, in / 4]   motif id (index into `block_motifs(N)`) of each 4x4 block

The persistent state is values + codes. `kept_index` unpacks the codes into an int64 flat index for compute;
callers cache it and rebuild it only when the codes change (research/sparse_kernels.md s2.2:
`index_copy_`/`index_select` with a cached flat index are the fastest CPU paths).
Pure tensor functions: no distributed code, no config objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distsparse.nm.patterns import M, block_motifs, motif_ids, row_patterns
from distsparse.nm.spec import NMSpec

_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


@dataclass
class NMMeta:
    """Index metadata of one compressed matrix: packed codes, the pattern spec and the dense shape."""
    codes: torch.Tensor
    spec: NMSpec
    shape: tuple[int, int]

    @property
    def kept_per_row(self) -> int:
        return self.spec.kept_per_row(self.shape[1])


def codes_shape(spec: NMSpec, out_features: int, in_features: int) -> tuple[int, int]:
    if spec.layout == "block":
        return (out_features // M, in_features // M)
    return (out_features, -(-spec.kept_per_row(in_features) // 4))


def _check_mask_shape(mask: torch.Tensor, spec: NMSpec) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask: expected a 2-D [out, in] tensor, got shape {tuple(mask.shape)}")
    spec.check_shape(*mask.shape, name="mask")


def _to_blocks(x: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/4, in/4, 4, 4]."""
    out_f, in_f = x.shape
    return x.reshape(out_f // M, M, in_f // M, M).transpose(1, 2)


def _from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[out/4, in/4, 4, 4] -> [out, in]."""
    bo, bi = blocks.shape[:2]
    return blocks.transpose(1, 2).reshape(bo * M, bi * M)


def group_counts_ok(mask: torch.Tensor, spec: NMSpec) -> bool:
    """True when every row group (and, block-wise, every block column) keeps exactly N."""
    out_f, in_f = mask.shape
    if not bool((mask.reshape(out_f, in_f // M, M).sum(-1) == spec.n).all()):
        return False
    if spec.layout == "block":
        return bool((_to_blocks(mask).sum(-2) == spec.n).all())
    return True


def encode(mask: torch.Tensor, spec: NMSpec) -> NMMeta:
    """Bool mask [out, in] -> NMMeta. Raises ValueError if the mask is not a legal `spec` pattern."""
    _check_mask_shape(mask, spec)
    mask = mask.bool()
    if not group_counts_ok(mask, spec):
        raise ValueError(f"mask is not a legal {spec} pattern: some group or block does not keep exactly {spec.n}")
    out_f, in_f = mask.shape
    if spec.layout == "block":
        codes = motif_ids(_to_blocks(mask), spec.n).to(torch.uint8)
        return NMMeta(codes, spec, (out_f, in_f))
    k = spec.kept_per_row(in_f)
    cols = mask.nonzero()[:, 1].view(out_f, k)   # row-major nonzero: kept columns of each row, ascending
    pos = (cols % M).to(torch.uint8)
    pad = (-k) % 4
    if pad:
        pos = torch.cat([pos, pos.new_zeros(out_f, pad)], dim=1)
    packed = (pos.view(out_f, -1, 4) << _SHIFTS.to(pos.device)).sum(-1, dtype=torch.uint8)
    return NMMeta(packed, spec, (out_f, in_f))


def _row_positions(meta: NMMeta) -> torch.Tensor:
    """Unpacked 2-bit positions, int64 [out, k]."""
    out_f = meta.shape[0]
    pos = (meta.codes.unsqueeze(-1) >> _SHIFTS.to(meta.codes.device)) & 3
    return pos.view(out_f, -1)[:, : meta.kept_per_row].long()


def decode(meta: NMMeta) -> torch.Tensor:
    """NMMeta -> bool mask [out, in]."""
    out_f, in_f = meta.shape
    if meta.spec.layout == "block":
        motifs = block_motifs(meta.spec.n, device=meta.codes.device)
        return _from_blocks(motifs[meta.codes.long()])
    mask = torch.zeros(out_f * in_f, dtype=torch.bool, device=meta.codes.device)
    mask[kept_index(meta)] = True
    return mask.view(out_f, in_f)


def kept_index(meta: NMMeta) -> torch.Tensor:
    """int64 [out * k]: flat position in the dense [out, in] matrix of every kept value, in values order."""
    out_f, in_f = meta.shape
    if meta.spec.layout == "block":
        return decode(meta).view(-1).nonzero().view(-1)
    k = meta.kept_per_row
    group = torch.arange(k, device=meta.codes.device) // meta.spec.n
    cols = group * M + _row_positions(meta)
    rows = torch.arange(out_f, device=meta.codes.device).unsqueeze(1)
    return (rows * in_f + cols).view(-1)


def is_legal(meta: NMMeta) -> bool:
    """True when the codes describe a legal pattern of `meta.spec` for `meta.shape`."""
    spec = meta.spec
    try:
        spec.check_shape(*meta.shape, name="meta")
    except ValueError:
        return False
    if tuple(meta.codes.shape) != codes_shape(spec, *meta.shape) or meta.codes.dtype != torch.uint8:
        return False
    if spec.layout == "block":
        return bool((meta.codes.long() < block_motifs(spec.n).shape[0]).all())
    pos = _row_positions(meta).view(meta.shape[0], -1, spec.n)
    if not bool((pos[..., 1:] > pos[..., :-1]).all()):   # strictly increasing: distinct, in position order
        return False
    # The padding slots of the last byte must be zero so that a code has one meaning.
    k = meta.kept_per_row
    full = ((meta.codes.unsqueeze(-1) >> _SHIFTS.to(meta.codes.device)) & 3).view(meta.shape[0], -1)
    return bool((full[:, k:] == 0).all())


def compress(dense: torch.Tensor, mask: torch.Tensor, spec: NMSpec) -> tuple[torch.Tensor, NMMeta]:
    """Dense [out, in] and a legal bool mask -> (values [out, k], meta)."""
    meta = encode(mask, spec)
    return gather_kept(dense, kept_index(meta), meta.kept_per_row), meta


def gather_kept(dense: torch.Tensor, index: torch.Tensor, kept_per_row: int) -> torch.Tensor:
    """Values [out, k] of dense [out, in] at a flat `kept_index`."""
    return dense.reshape(-1).index_select(0, index).view(-1, kept_per_row)


def scatter_kept(values: torch.Tensor, index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Dense [out, in] with `values` at a flat `kept_index` (int64, or int32 as layers cache it) and zeros
    elsewhere."""
    dense = values.new_zeros(shape[0] * shape[1])
    if index.dtype == torch.int64:
        return dense.index_copy_(0, index, values.reshape(-1)).view(shape)
    return dense.index_put_((index,), values.reshape(-1)).view(shape)   # index_copy_ takes int64 only


def decompress(values: torch.Tensor, meta: NMMeta) -> torch.Tensor:
    """(values [out, k], meta) -> dense [out, in] with zeros at pruned positions."""
    return scatter_kept(values, kept_index(meta), meta.shape)


def mask_from_scores(scores: torch.Tensor, n: int, layout: str) -> torch.Tensor:
    """Best legal bool mask for `scores` [out, in]: top-n per row group, or the motif with the largest
    summed score per 4x4 block (Apex ASP's `m4n2_2d_best` selection, one matmul against the library)."""
    spec = NMSpec(n, M, layout)
    _check_mask_shape(scores, spec)
    out_f, in_f = scores.shape
    if layout == "row":
        top = scores.reshape(out_f, in_f // M, M).topk(n, dim=-1).indices
        mask = torch.zeros(out_f, in_f // M, M, dtype=torch.bool, device=scores.device)
        return mask.scatter_(-1, top, True).view(out_f, in_f)
    motifs = block_motifs(n, device=scores.device)
    blocks = _to_blocks(scores).reshape(out_f // M, in_f // M, M * M)
    work = torch.promote_types(scores.dtype, torch.float32)   # float64 scores keep their precision
    gain = blocks.to(work) @ motifs.view(-1, M * M).to(work).T   # [out/4, in/4, P]
    return _from_blocks(motifs[gain.argmax(-1)])


def random_mask(out_features: int, in_features: int, spec: NMSpec,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """A uniformly random legal pattern per row group (or per 4x4 block), drawn from `generator`."""
    spec.check_shape(out_features, in_features)
    if spec.layout == "row":
        library = row_patterns(spec.n)
        choice = torch.randint(len(library), (out_features, in_features // M), generator=generator)
        return library[choice].view(out_features, in_features)
    library = block_motifs(spec.n)
    choice = torch.randint(len(library), (out_features // M, in_features // M), generator=generator)
    return _from_blocks(library[choice])
