"""Dense-latent baselines: STE, SR-STE and CAST against float64 references and brute-force masks."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from distsparse.layers.dense_latent import DenseLatentLinear, cast_metrics
from distsparse.nm import NMSpec, encode, is_legal
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.hparams import AdamSHParams

F64 = torch.float64


def _brute_force_mask(weight: torch.Tensor, n: int, layout: str) -> torch.Tensor:
    """Best legal mask by enumeration: the n largest |w| of each row group of 4, or the 4x4 block pattern with n
    per row and per column and the largest sum of |w| among all 0/1 blocks (no pattern library involved)."""
    w = weight.abs().double()
    mask = torch.zeros_like(w, dtype=torch.bool)
    if layout == "row":
        for r in range(w.shape[0]):
            for c in range(0, w.shape[1], 4):
                group = w[r, c:c + 4].tolist()
                for j in sorted(range(4), key=lambda j: -group[j])[:n]:
                    mask[r, c + j] = True
        return mask
    rows = [p for p in itertools.product((0, 1), repeat=4) if sum(p) == n]
    blocks = [b for b in itertools.product(rows, repeat=4) if all(sum(row[c] for row in b) == n for c in range(4))]
    blocks = torch.tensor(blocks, dtype=F64)                                    # [P, 4, 4]
    for r in range(0, w.shape[0], 4):
        for c in range(0, w.shape[1], 4):
            gains = (blocks * w[r:r + 4, c:c + 4]).sum((1, 2))
            mask[r:r + 4, c:c + 4] = blocks[gains.argmax()].bool()
    return mask


def _layer(mode: str, spec: NMSpec | None, seed: int = 0, **kw) -> DenseLatentLinear:
    return DenseLatentLinear(16, 8, spec, mode, seed=seed, dtype=F64, init_std=1.0, **kw)


@pytest.mark.parametrize("spec", [NMSpec(1, 4, "row"), NMSpec(2, 4, "row"), NMSpec(1, 4, "block"),
                                  NMSpec(2, 4, "block")], ids=str)
def test_ste_forward_is_the_masked_dense_forward_and_its_weight_gradient_the_dense_one(spec):
    layer = _layer("ste", spec)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen, dtype=F64, requires_grad=True)
    upstream = torch.randn(5, 8, generator=gen, dtype=F64)
    mask = _brute_force_mask(layer.weight.detach(), spec.n, spec.layout)
    masked = (layer.weight.detach() * mask).requires_grad_()
    ref_y = x.detach() @ masked.T
    ref_y.backward(upstream)
    y = layer(x)
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    y.backward(upstream)
    torch.testing.assert_close(layer.weight.grad, masked.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight.grad, upstream.T @ x.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, upstream @ masked.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(layer.current_mask(), mask) and torch.equal(layer.export_weight(), layer.weight * mask)


@pytest.mark.parametrize("spec", [NMSpec(2, 4, "row"), NMSpec(1, 4, "block")], ids=str)
def test_srste_extra_gradient_is_lambda_w_times_w_on_pruned_entries_and_zero_on_kept(spec):
    ste, srste = _layer("ste", spec), _layer("srste", spec, lambda_w=1e-2)
    assert torch.equal(ste.weight, srste.weight)
    assert DenseLatentLinear(16, 8, spec, "srste").lambda_w == 1e-4          # App. H.2
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=gen, dtype=F64)
    upstream = torch.randn(5, 8, generator=gen, dtype=F64)
    ste(x).backward(upstream)
    srste(x).backward(upstream)
    pruned = ~_brute_force_mask(srste.weight.detach(), spec.n, spec.layout)
    extra = srste.weight.grad - ste.weight.grad
    assert torch.equal(extra[~pruned], torch.zeros_like(extra[~pruned]))
    assert torch.equal(srste.weight.grad[pruned], ste.weight.grad[pruned] + 1e-2 * srste.weight.detach()[pruned])
    assert pruned.any() and (extra[pruned] != 0).all()


def _cast_with_scales(spec=NMSpec(2, 4, "row")) -> DenseLatentLinear:
    layer = _layer("cast", spec)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.scale.copy_(torch.rand(8, 2, generator=gen) * 2 - 0.5)         # some negative scales too
    return layer


def _scaled_ref(layer: DenseLatentLinear) -> torch.Tensor:
    """W * s with s[r, g] on columns g * I/G ... (g + 1) * I/G - 1, in float64."""
    scale = layer.scale.detach().double().repeat_interleave(16 // 2, dim=1)
    return layer.weight.detach() * scale


def test_cast_export_is_legal_and_equals_the_projection_of_the_scaled_weight():
    layer = _cast_with_scales()
    scaled = _scaled_ref(layer)
    expected = scaled * _brute_force_mask(scaled, 2, "row")
    exported = layer.export_weight()
    torch.testing.assert_close(exported, expected, rtol=1e-12, atol=0)
    meta = encode(exported != 0, NMSpec(2, 4, "row"))
    assert is_legal(meta)
    assert torch.equal(layer.export_mask(), exported != 0)
    assert layer.scale.dtype == torch.float32


def test_cast_projection_cut_is_the_pruned_share_of_the_scaled_weights_squared_norm():
    layers = [_cast_with_scales(), _cast_with_scales()]
    with torch.no_grad():
        layers[1].weight.mul_(3.0)
    cut = total = 0.0
    for layer in layers:
        scaled = _scaled_ref(layer)
        cut += float((scaled * ~_brute_force_mask(scaled, 2, "row")).square().sum())
        total += float(scaled.square().sum())
    assert 0 < cut < total
    ste = _layer("ste", NMSpec(2, 4, "row"))
    assert cast_metrics([*layers, ste]) == pytest.approx({"cast/projection_cut": cut / total}, rel=1e-12)
    assert cast_metrics([ste]) == {}


def test_cast_trains_on_the_scaled_dense_weight_and_evaluates_on_the_projection():
    layer = _cast_with_scales()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4), dtype=F64)
    scaled = _scaled_ref(layer)
    torch.testing.assert_close(layer(x), x @ scaled.T, rtol=1e-12, atol=1e-12)
    layer.eval()
    projected = scaled * _brute_force_mask(scaled, 2, "row")
    torch.testing.assert_close(layer(x), x @ projected.T, rtol=1e-12, atol=1e-12)


def test_cast_mask_is_refreshed_only_every_interval_steps():
    layer = _cast_with_scales()
    old_mask = layer.current_mask().clone()
    assert torch.equal(old_mask, _brute_force_mask(_scaled_ref(layer), 2, "row"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(5), dtype=F64))
    new_mask = _brute_force_mask(_scaled_ref(layer), 2, "row")
    assert not torch.equal(old_mask, new_mask)
    assert layer.maybe_update_mask(13) is False
    assert torch.equal(layer.current_mask(), old_mask)
    assert layer.maybe_update_mask(20) is True
    assert torch.equal(layer.current_mask(), new_mask)
    assert "codes" in layer.state_dict()


def test_engine_adams_step_decays_only_outside_the_cast_support():
    layer = DenseLatentLinear(16, 8, NMSpec(1, 4, "row"), "cast", seed=4, init_std=1.0)
    layer.weight.requires_grad_(True)
    support, before = layer.current_mask(), layer.weight.detach().clone()
    engine = MatrixEngine({"cast": layer}, rule="adams", hparams=AdamSHParams(lambda_w=1e-2))
    engine.step(lr=1e-3)                       # a zero gradient: only the decay moves anything
    after = layer.weight.detach()
    assert torch.equal(after[support], before[support])
    assert (after[~support] != before[~support]).all()


def test_blockwise_cast_is_refused_with_the_papers_reason():
    with pytest.raises(ValueError, match=r"layout.*'block'.*'cast'.*allowed: row.*dense forward.*App\. H\.3"):
        DenseLatentLinear(16, 8, NMSpec(2, 4, "block"), "cast")


def test_bad_modes_specs_and_group_counts_are_rejected_by_name():
    with pytest.raises(ValueError, match=r"mode: got 'sste'.*dense, ste, srste, cast"):
        DenseLatentLinear(16, 8, NMSpec(2), "sste")
    with pytest.raises(ValueError, match=r"sparsity: got none for mode 'ste'"):
        DenseLatentLinear(16, 8, None, "ste")
    with pytest.raises(ValueError, match=r"num_scale_groups: got 3 for in_features=16"):
        DenseLatentLinear(16, 8, NMSpec(2), "cast", num_scale_groups=3)


def test_dense_mode_is_a_plain_linear_with_a_mask_of_ones():
    layer = DenseLatentLinear(16, 8, None, "dense", bias=True, dtype=F64)
    x = torch.randn(3, 16, dtype=F64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    assert layer.current_mask().all() and torch.equal(layer.export_weight(), layer.weight.detach())


def test_bf16_ste_and_cast_run_and_keep_fp32_scales():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    for mode in ("ste", "srste", "cast"):
        layer = DenseLatentLinear(16, 8, NMSpec(1), mode, dtype=torch.bfloat16)
        layer(x).float().sum().backward()
        assert layer.weight.grad.dtype == torch.bfloat16
    assert layer.scale.dtype == torch.float32 and layer.scale.grad.dtype == torch.float32
