"""N:M pattern libraries and compressed storage (values + packed index metadata)."""

from distsparse.nm.patterns import block_motifs, motif_ids, row_patterns
from distsparse.nm.slots import move_slots, slot_map
from distsparse.nm.spec import NMSpec
from distsparse.nm.storage import (
    NMMeta, bag_key, bags_tile, codes_shape, compress, decode, decompress, decompress_bags, decompress_groups, encode,
    gather_bags, gather_groups, gather_kept, group_counts_ok, is_legal, kept_index, kept_positions, lookup_key,
    mask_from_scores, random_mask, scatter_groups, scatter_kept,
)

__all__ = [
    "NMMeta", "NMSpec", "bag_key", "bags_tile", "block_motifs", "codes_shape", "compress", "decode", "decompress",
    "decompress_bags", "decompress_groups", "encode", "gather_bags", "gather_groups", "gather_kept", "group_counts_ok",
    "is_legal", "kept_index", "kept_positions", "lookup_key", "mask_from_scores", "motif_ids", "move_slots",
    "random_mask", "row_patterns", "scatter_groups", "scatter_kept", "slot_map",
]
