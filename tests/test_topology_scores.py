"""CH2-L3n / CH3-L3n matrix scores against a brute-force node-based enumeration (research/cht_topology.md s1a,
s1b), written here with python loops over L3 paths and local-community sets."""

import pytest
import torch

from distsparse.nm import NMSpec, random_mask
from distsparse.topology import ch_scores


def node_based_reference(mask: torch.Tensor, variant: str) -> torch.Tensor:
    """S[u, v] = sum over local-community nodes z of (1 + di(z)) / (1 + de(z)) (CH2) or 1 / (1 + de(z)) (CH3),
    for every missing link (u, v): LC = nodes on the L3 paths u - c - b - v, di(z) = |N(z) & LC|,
    de(z) = deg(z) - di(z) - [z ~ u] - [z ~ v] (s1a), aggregated once per node (s1b)."""
    out_f, in_f = mask.shape
    adj = mask.tolist()
    nbr_of_out = [{c for c in range(in_f) if adj[u][c]} for u in range(out_f)]
    nbr_of_in = [{b for b in range(out_f) if adj[b][v]} for v in range(in_f)]

    def factor(di: int, de: int) -> float:
        return (1.0 + di) / (1.0 + de) if variant == "ch2" else 1.0 / (1.0 + de)

    ref = torch.zeros(out_f, in_f, dtype=torch.float64)
    for u in range(out_f):
        for v in range(in_f):
            if adj[u][v]:
                continue
            paths = [(c, b) for c in nbr_of_out[u] for b in nbr_of_in[v] if adj[b][c]]
            lc_in, lc_out = {c for c, _ in paths}, {b for _, b in paths}
            total = 0.0
            for b in lc_out:        # output node: neighbours are inputs; b ~ v, never b ~ u (bipartite)
                di = len(nbr_of_out[b] & lc_in)
                total += factor(di, len(nbr_of_out[b]) - di - (v in nbr_of_out[b]))
            for c in lc_in:         # input node: c ~ u, never c ~ v
                di = len(nbr_of_in[c] & lc_out)
                total += factor(di, len(nbr_of_in[c]) - di - (u in nbr_of_in[c]))
            ref[u, v] = total
    return ref


@pytest.mark.parametrize("variant", ["ch2", "ch3"])
def test_matrix_scores_equal_the_node_based_enumeration_on_random_bipartite_masks(variant):
    gen = torch.Generator().manual_seed(7)
    for trial in range(12):
        out_f, in_f = torch.randint(2, 12, (2,), generator=gen).tolist()
        density = [0.15, 0.3, 0.5, 0.8][trial % 4]
        mask = torch.rand(out_f, in_f, generator=gen) < density
        got = ch_scores(mask, variant, chunk_size=3)
        torch.testing.assert_close(got.double(), node_based_reference(mask, variant), rtol=1e-6, atol=1e-6)


def test_scores_on_an_nm_mask_match_the_enumeration_and_are_not_trivial():
    mask = random_mask(8, 16, NMSpec(2, 4, "row"), torch.Generator().manual_seed(3))
    got = ch_scores(mask, "ch2")
    torch.testing.assert_close(got.double(), node_based_reference(mask, "ch2"), rtol=1e-6, atol=1e-6)
    assert float(got[~mask].min()) > 0.0       # at 50% density every candidate lies on some L3 path


@pytest.mark.parametrize("variant", ["ch2", "ch3"])
def test_chunked_scores_equal_unchunked_scores(variant):
    mask = random_mask(36, 52, NMSpec(1, 4, "row"), torch.Generator().manual_seed(11))
    whole = ch_scores(mask, variant, chunk_size=10_000)
    for chunk in (1, 5, 16, 36):
        torch.testing.assert_close(ch_scores(mask, variant, chunk_size=chunk), whole, rtol=1e-6, atol=0.0)


def test_existing_links_score_zero_and_scores_are_fp32():
    mask = torch.rand(9, 13, generator=torch.Generator().manual_seed(5)) < 0.4
    got = ch_scores(mask)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    assert bool((got[mask] == 0).all())


def test_bad_variant_and_chunk_size_are_refused_by_name():
    mask = torch.zeros(4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="score: got 'ch4'"):
        ch_scores(mask, "ch4")
    with pytest.raises(ValueError, match="chunk_size: got 0"):
        ch_scores(mask, chunk_size=0)
