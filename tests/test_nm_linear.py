"""NMSparseLinear (distsparse/layers/nm_linear.py) against a float64 dense masked reference built here:
outputs, gradients, saved tensors, checkpointing, persistent and held bytes, optimizer steps, errors and init."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from bench.memory import held_bytes
from distsparse.op_count import count_ops
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from distsparse.layers import NMLinearFunction, NMSparseLinear
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.projection import SparseProjection
from distsparse.nm import (
    NMSpec, decode, encode, gather_kept, kept_index, move_slots, random_mask, scatter_kept, slot_map,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = [NMSpec(n, 4, layout) for n in (1, 2, 3) for layout in ("row", "block")]


def dense_masked_weight(layer):
    """W [out, in]: zeros, with each row's values written at its kept columns in ascending order."""
    mask = decode(layer.meta)
    weight = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64)
    weight[mask] = layer.values.detach().double().flatten()   # boolean assignment is row-major
    return weight, mask


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_outputs_and_gradients_equal_a_float64_dense_masked_reference(spec):
    layer = NMSparseLinear(16, 12, spec, bias=True, dtype=torch.float64, seed=3)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(2, 5, 12, dtype=torch.float64)
    layer(x).backward(grad_y)

    weight, mask = dense_masked_weight(layer)
    weight.requires_grad_(True)
    bias = layer.bias.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.einsum("bti,oi->bto", x_ref, weight) + bias
    y_ref.backward(grad_y)

    torch.testing.assert_close(layer(x), y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, bias.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.values.grad, weight.grad[mask].view(12, -1), rtol=1e-12, atol=1e-12)


def flat_index_reference(layer, x, grad_y):
    """(y, grad_x, grad_values, grad_bias) by the flat kept index, the arithmetic of the layer before issue 25: W by
    index_copy_ at kept_index, the same three GEMMs on [T, I] / [T, O] views, grad_values by index_select."""
    out_f, in_f = layer.out_features, layer.in_features
    index = kept_index(layer.meta)
    weight = scatter_kept(layer.values.detach(), index, (out_f, in_f))
    y = torch.nn.functional.linear(x, weight, layer.bias)
    g2 = grad_y.reshape(-1, out_f)
    grad_x = (g2 @ weight).view(*grad_y.shape[:-1], in_f)
    grad_values = gather_kept(g2.t() @ x.reshape(-1, in_f), index, layer.values.shape[1])
    return y, grad_x, grad_values, g2.sum(0)


def bits(t):
    return t.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("in_f", [16, 20])   # 20: at 1:4 and 3:4 the last code byte of each row is padded
def test_outputs_and_gradients_are_bit_identical_to_the_flat_index_arithmetic(spec, in_f):
    layer = NMSparseLinear(in_f, 12, spec, bias=True, seed=7)
    with torch.no_grad():
        layer.bias.normal_()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, in_f, generator=gen, requires_grad=True)
    grad_y = torch.randn(3, 5, 12, generator=gen)
    y = layer(x)
    y.backward(grad_y)
    want = flat_index_reference(layer, x.detach(), grad_y)
    for got, ref in zip((y, x.grad, layer.values.grad, layer.bias.grad), want):
        assert got.shape == ref.shape and torch.equal(bits(got), bits(ref))


def aten_ops(module, x, grad_y):
    """Aten ops (views included) of one warm forward + backward, counted by the benchmarks' counter."""

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).backward(grad_y)

    step()   # the lookup tables are built on a first call
    return count_ops(step)[0].ops


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("lead", [(6,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_forward_and_backward_dispatch_at_most_three_times_the_ops_of_nn_linear(spec, lead, bias):
    # Issue 25: device-independent, every op a launch or a dispatch on a GPU; the hardened permutation's gather and
    # its backward count in the layer's budget too.
    in_f, out_f = 32, 24
    x = torch.randn(*lead, in_f, requires_grad=True)
    grad_y = torch.randn(*lead, out_f)
    linear = aten_ops(nn.Linear(in_f, out_f, bias=bias), x, grad_y)
    sparse = aten_ops(NMSparseLinear(in_f, out_f, spec, bias=bias), x, grad_y)
    permuted = aten_ops(SparseProjection(NMSparseLinear(in_f, out_f, spec, bias=bias),
                                         permutation=BlockPermutation(in_f, 8, "random", seed=1)), x, grad_y)
    assert sparse <= 3 * linear and permuted <= 3 * linear, (sparse, permuted, linear)


@pytest.mark.parametrize("spec, in_f", [(NMSpec(1), 8), (NMSpec(1), 16), (NMSpec(2, 4, "block"), 8)],
                         ids=["1:4-row-lookup", "1:4-row-bags", "2:4-block-bags"])
def test_function_passes_gradcheck_in_float64(spec, in_f):
    layer = NMSparseLinear(in_f, 8, spec, dtype=torch.float64)
    values = layer.values.detach().clone().requires_grad_(True)
    bias = torch.randn(8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, in_f, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, v, b: NMLinearFunction.apply(x, v, layer.codes, spec, in_f, b), (x, values, bias))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_the_one_dense_weight_sized_tensor_saved_for_backward_is_the_decompressed_weight(spec):
    # Issue 25: backward multiplies by the forward's W (one dense weight per projection held from forward to
    # backward) instead of decompressing again; x is saved too, and nothing else is weight-sized.
    out_f, in_f = 12, 16
    layer = NMSparseLinear(in_f, out_f, spec, bias=True, dtype=torch.float64)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(torch.randn(5, in_f, dtype=torch.float64, requires_grad=True))
    dense = [t for t in saved if t.numel() == out_f * in_f]
    assert len(dense) == 1 and dense[0].shape == (out_f, in_f), [tuple(t.shape) for t in saved]
    assert torch.equal(dense[0], dense_masked_weight(layer)[0])
    y.sum().backward()


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("in_f", [16, 20])   # 20: padding slots at 1:4, 2:4 and 3:4 row-wise (the group lookup)
def test_a_forward_and_backward_decompress_the_weight_once(spec, in_f):
    # Bags (every block-wise shape, row-wise widths without padding slots): one add for the key, one embedding bag
    # for W, one per-sample-weights gradient for grad_values, and nothing else beside the GEMMs. The group lookup
    # (padding slots): one cast, one embedding each way, W by one mul of one-hot rows at N = 1 or new_zeros +
    # scatter_ above, one gather. A backward rebuilding W would add a second decompression either way.
    layer = NMSparseLinear(in_f, 12, spec)
    x = torch.randn(5, in_f, requires_grad=True)
    layer(x).sum().backward()   # the lookup tables are built on a first call
    by_op = count_ops(lambda: layer(x).sum().backward())[0].by_op
    if spec.layout == "block" or in_f == 16:
        assert by_op["aten._embedding_bag_forward_only.default"] == 1, by_op
        assert by_op["aten._embedding_bag_per_sample_weights_backward.default"] == 1, by_op
        assert by_op["aten.add.Tensor"] == 1 and by_op["aten._to_copy.default"] == 0, by_op   # the key, no cast
        kernels = {"aten.mm.default", "aten.add.Tensor", "aten._embedding_bag_forward_only.default",
                   "aten._embedding_bag_per_sample_weights_backward.default", "aten.sum.default",
                   "aten.ones_like.default", "aten.add_.Tensor"}   # sum().backward(), grad accumulation into .grad
        views = {"aten.view.default", "aten.t.default", "aten.expand.default", "aten._unsafe_view.default",
                 "aten.detach.default"}
        assert set(by_op) <= kernels | views, by_op
    else:
        scatters = 0 if spec.n == 1 else 1
        assert by_op["aten.scatter_.src"] == by_op["aten.new_zeros.default"] == scatters, by_op
        assert by_op["aten.mul.Tensor"] == 1 - scatters, by_op   # sum().backward() expands, it does not multiply
        assert by_op["aten.embedding.default"] == 2 and by_op["aten.gather.default"] == 1, by_op
        assert by_op["aten._to_copy.default"] == 1, by_op   # the key, cast once for both lookups


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("in_f", [16, 20])
def test_the_function_saves_the_codes_and_one_int32_key_and_no_int64_index(spec, in_f):
    # The key W was built from is saved for backward's gather: bags, 4 B per kept value (one table row per slot);
    # the group lookup, the codes cast (4 B per code byte). No int64 positions or flat index (8 B per kept value).
    layer = NMSparseLinear(in_f, 12, spec, bias=True)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(torch.randn(5, in_f, requires_grad=True))
    integer = [t for t in saved if not t.is_floating_point()]
    assert [t.dtype for t in integer] == [torch.uint8, torch.int32], [t.dtype for t in integer]
    codes, key = integer
    assert codes.data_ptr() == layer.codes.data_ptr()   # the layer's buffer itself, not a copy
    kept = layer.values.numel()
    assert key.numel() == kept or torch.equal(key, codes.int()), (key.shape, codes.shape)
    y.sum().backward()


def test_codes_changed_between_forward_and_backward_are_refused():
    layer = NMSparseLinear(16, 12, NMSpec(2), seed=1)
    y = layer(torch.randn(5, 16))
    layer.set_codes(NMSparseLinear(16, 12, NMSpec(2), seed=2).codes)   # a topology installed mid-step
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def two_layer_grads(net, x, mode):
    x = x.detach().clone().requires_grad_(True)

    def run(inp):
        return net[1](torch.nn.functional.gelu(net[0](inp)))

    net.zero_grad(set_to_none=True)
    if mode == "plain":
        y = run(x)
    else:
        y = checkpoint(run, x, use_reentrant=(mode == "reentrant"))
    (y ** 2).sum().backward()
    return [x.grad] + [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("first, second", [(NMSpec(2), NMSpec(1, 4, "block")), (NMSpec(1), NMSpec(3, 4, "block")),
                                           (NMSpec(3), NMSpec(2, 4, "block"))], ids=str)
def test_activation_checkpointing_reentrant_or_not_gives_the_plain_gradients(first, second):
    net = nn.Sequential(NMSparseLinear(16, 12, first, bias=True, seed=1),
                        NMSparseLinear(12, 8, second, bias=True, seed=2))
    x = torch.randn(6, 16)
    plain = two_layer_grads(net, x, "plain")
    for mode in ("reentrant", "non_reentrant"):
        grads = two_layer_grads(net, x, mode)
        assert len(grads) == len(plain) == 5
        for got, want in zip(grads, plain):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def state_bytes(module):
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module.state_dict().values()}
    return sum(storages.values())


@pytest.mark.parametrize("layout", ["row", "block"])
@pytest.mark.parametrize("sparsity, bound", [("1:4", 0.29), ("2:4", 0.57), ("3:4", None)])
@pytest.mark.parametrize("in_f, out_f", [(40, 24), (512, 1376)])
def test_a_trained_layer_holds_bf16_values_plus_packed_codes_and_nothing_else(layout, sparsity, bound, in_f, out_f):
    spec = NMSpec.parse(sparsity, layout)
    k = in_f * spec.n // 4
    layer = NMSparseLinear(in_f, out_f, spec, dtype=torch.bfloat16)
    x = torch.randn(3, in_f, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    checkpoint(layer, x, use_reentrant=True).sum().backward()
    assert layer.index.numel() == out_f * k   # what the engine reads: derived on access, not kept
    layer.zero_grad(set_to_none=True)         # between steps gradients live in the engine's buffer

    code_bytes = out_f * -(-k // 4) if layout == "row" else (out_f // 4) * (in_f // 4)   # DESIGN s3
    assert set(layer.state_dict()) == {"values", "codes"}
    assert state_bytes(layer) == out_f * k * 2 + code_bytes
    assert held_bytes(layer) == out_f * k * 2 + code_bytes   # no index cache, no other tensor attribute
    if bound is not None:
        assert held_bytes(layer) <= bound * out_f * in_f * 2


@pytest.mark.parametrize("spec", [NMSpec(1), NMSpec(2, 4, "block")], ids=str)
def test_pruned_positions_stay_zero_through_adamw_steps(spec):
    layer = NMSparseLinear(16, 12, spec, bias=True)
    assert all(p.numel() != 12 * 16 for p in layer.parameters())
    mask = decode(layer.meta).clone()
    before = layer.values.detach().clone()
    opt = torch.optim.AdamW(layer.parameters(), lr=0.05, weight_decay=0.1)
    x, target = torch.randn(32, 16), torch.randn(32, 12)
    for _ in range(4):
        opt.zero_grad()
        ((layer(x) - target) ** 2).mean().backward()
        opt.step()
    weight = layer.dense_weight()
    assert torch.equal(decode(layer.meta), mask)
    assert torch.count_nonzero(weight[~mask]) == 0
    assert torch.equal(weight[mask], layer.values.detach().flatten())
    assert bool((layer.values.detach() != before).all())


def test_loading_a_state_dict_or_setting_codes_changes_what_the_layer_computes():
    a = NMSparseLinear(16, 8, NMSpec(2), seed=0)
    b = NMSparseLinear(16, 8, NMSpec(2), seed=1)
    x = torch.randn(3, 16)
    b(x)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)

    new_codes = encode(random_mask(8, 16, NMSpec(2), torch.Generator().manual_seed(5)), NMSpec(2)).codes
    slots = slot_map(b.meta, type(b.meta)(new_codes, b.spec, b.meta.shape))
    with torch.no_grad():
        b.values.copy_(move_slots(b.values, slots, fill=0.0))
    b.set_codes(new_codes)
    weight, _ = dense_masked_weight(b)
    torch.testing.assert_close(b(x).double(), x.double() @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build, needle, allowed", [
    (lambda: NMSparseLinear(6, 8, NMSpec(1)), "in_features=6", "multiple of 4"),
    (lambda: NMSparseLinear(8, 6, NMSpec(2, 4, "block")), "out_features=6", "multiples of 4"),
    (lambda: NMSpec(4), "got 4", "1, 2, 3"),
    (lambda: NMSpec(1, 8), "got 8", "4"),
    (lambda: NMSpec(1, 4, "diag"), "'diag'", "row, block"),
    (lambda: NMSpec.parse("3:5"), "'3:5'", "1:4, 2:4, 3:4"),
    (lambda: NMSpec.parse("half"), "'half'", "1:4, 2:4, 3:4"),
    (lambda: NMSparseLinear(8, 8, NMSpec(1), init="xavier"), "'xavier'", "swi, hf"),
])
def test_bad_shapes_and_settings_raise_one_value_error_naming_value_and_allowed(build, needle, allowed):
    with pytest.raises(ValueError) as err:
        build()
    assert needle in str(err.value) and allowed in str(err.value), str(err.value)


@pytest.mark.parametrize("sparsity", ["1:4", "2:4"])
def test_swi_init_std_is_sqrt_two_over_density_times_fan_in(sparsity):
    spec = NMSpec.parse(sparsity)
    layer = NMSparseLinear(256, 128, spec, init="swi")
    values = layer.values.detach().double().flatten()
    expected = math.sqrt(2.0 / (spec.n / 4 * 256))
    # >= 8192 samples: the relative standard error of a std estimate is 1/sqrt(2 n) < 0.8 %.
    assert abs(values.std().item() / expected - 1) < 0.04
    assert abs(values.mean().item()) < 4 * expected / math.sqrt(values.numel())
    hf = NMSparseLinear(256, 128, spec, init="hf", init_std=0.02)
    assert abs(hf.values.detach().double().std().item() / 0.02 - 1) < 0.04


def test_the_same_seed_gives_the_same_layer_and_another_seed_does_not():
    a, b = (NMSparseLinear(32, 16, NMSpec(2, 4, "block"), seed=11) for _ in range(2))
    c = NMSparseLinear(32, 16, NMSpec(2, 4, "block"), seed=12)
    assert torch.equal(a.values, b.values) and torch.equal(a.codes, b.codes)
    assert not torch.equal(a.values, c.values) and not torch.equal(a.codes, c.codes)


@pytest.mark.parametrize("spec", [NMSpec(1), NMSpec(2, 4, "block")], ids=str)
def test_a_layer_built_on_meta_then_materialized_equals_one_built_directly(spec):
    direct = NMSparseLinear(32, 16, spec, bias=True, seed=4)
    lazy = NMSparseLinear(32, 16, spec, bias=True, seed=4, device="meta")
    assert lazy.values.is_meta
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(lazy.state_dict()[name], tensor), name
    x = torch.randn(3, 32)
    torch.testing.assert_close(lazy(x), direct(x), rtol=0, atol=0)


def test_copy_to_another_dtype_keeps_the_topology():
    layer = NMSparseLinear(16, 8, NMSpec(2), seed=2)
    half = copy.deepcopy(layer).to(torch.bfloat16)
    assert half.codes.dtype == torch.uint8 and torch.equal(half.codes, layer.codes)
    torch.testing.assert_close(half.dense_weight().float(), layer.dense_weight(), rtol=1e-2, atol=1e-2)


def independent_mask(out_f, in_f, spec, gen):
    """Bool [out, in]: row-wise, n columns of every group of 4 drawn here by randperm (no code of the package);
    block-wise, `random_mask`'s legal motifs (the library is the spec). The layer is given `encode(mask)`'s codes,
    the reference the mask itself, so a wrong bag table, key or slot order in the layer cannot cancel out."""
    if spec.layout == "block":
        return random_mask(out_f, in_f, spec, gen)
    mask = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool)
    for o in range(out_f):
        for g in range(in_f // 4):
            mask[o, g, torch.randperm(4, generator=gen)[:spec.n]] = True
    return mask.view(out_f, in_f)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("in_f", [32, 20], ids=["bags", "padding"])   # 20: padded last code byte row-wise
@pytest.mark.parametrize("spec", [NMSpec(n, 4, layout) for n in (1, 2) for layout in ("row", "block")], ids=str)
def test_fp32_and_bf16_layers_equal_a_float64_reference_built_from_the_mask(spec, in_f, dtype, tol):
    # Output, input gradient and kept-value gradient of a layer in its training dtype against float64 algebra on
    # the dense masked weight; each error relative to the reference's largest entry (bf16 rounds every GEMM).
    out_f, gen = 12, torch.Generator().manual_seed(in_f + spec.n)
    mask = independent_mask(out_f, in_f, spec, gen)
    layer = NMSparseLinear(in_f, out_f, spec, bias=True, dtype=dtype)
    layer.set_codes(encode(mask, spec).codes)
    with torch.no_grad():
        layer.values.copy_(torch.randn(layer.values.shape, generator=gen))
        layer.bias.copy_(torch.randn(out_f, generator=gen))
    x = torch.randn(3, 5, in_f, generator=gen).to(dtype).requires_grad_(True)
    grad_y = torch.randn(3, 5, out_f, generator=gen).to(dtype)
    y = layer(x)
    y.backward(grad_y)

    weight = torch.zeros(out_f, in_f, dtype=torch.float64)
    weight[mask] = layer.values.detach().double().flatten()   # row-major: each row's values at ascending columns
    x64, g64 = x.detach().double().reshape(-1, in_f), grad_y.double().reshape(-1, out_f)
    expected = {"y": x64 @ weight.T + layer.bias.detach().double(), "grad_x": g64 @ weight,
                "grad_values": (g64.T @ x64)[mask].view(out_f, -1)}
    got = {"y": y.reshape(-1, out_f), "grad_x": x.grad.reshape(-1, in_f), "grad_values": layer.values.grad}
    for name, ref in expected.items():
        assert got[name].dtype == dtype, name
        err = (got[name].double() - ref).abs().max().item() / ref.abs().max().item()
        assert err <= tol, (name, err)


@pytest.mark.parametrize("in_f", [16, 20], ids=["bags", "padding"])
def test_the_saved_key_and_weight_are_freed_by_the_backward(in_f):
    # The int32 key and W live from forward to backward only: once backward ran, nothing holds them, even while the
    # output and its graph are still referenced (the dry run counts them as activations, test_dry_run).
    import weakref
    layer = NMSparseLinear(in_f, 12, NMSpec(1))
    refs = []
    with saved_tensors_hooks(lambda t: refs.append(weakref.ref(t)) or t, lambda t: t):
        y = layer(torch.randn(5, in_f, requires_grad=True))
    held = [r for r in refs if r().dtype == torch.int32 or r().shape == (12, in_f)]   # the key, W
    assert len(held) == 2
    y.sum().backward()
    assert [r() for r in held] == [None, None]


@pytest.mark.parametrize("spec", [NMSpec(1), NMSpec(2), NMSpec(2, 4, "block")], ids=str)
def test_an_inf_at_a_pruned_weight_gradient_reaches_the_kept_gradients_of_its_row_as_nonfinite(spec):
    # The bags' per-sample-weights gradient multiplies a whole span of grad_W by a one-hot row, so a non-finite
    # grad_W at a pruned position makes the kept gradients of its span nan (0 x inf), where a gather dropped it: the
    # engine's finiteness check then skips the step (test_joint_step's backbone nan; test_engine's check) instead of
    # applying it. x inf at one column: grad_W's whole column is non-finite, pruned in some rows, kept in others;
    # every row must come out non-finite, and every finite kept gradient equal the float64 reference.
    out_f, in_f = 8, 16
    layer = NMSparseLinear(in_f, out_f, spec, dtype=torch.float32)
    _, mask = dense_masked_weight(layer)
    col = 5
    assert (~mask[:, col]).any()   # pruned in some row: the case a gather drops
    x = torch.randn(3, in_f)
    x[1, col] = float("inf")
    grad_y = torch.randn(3, out_f)
    layer(x).backward(grad_y)
    grad = layer.values.grad
    assert not torch.isfinite(grad).all(dim=1).any(), grad
    expected = (grad_y.double().T @ x.double())[mask].view(out_f, -1)
    finite = torch.isfinite(grad)
    torch.testing.assert_close(grad[finite].double(), expected[finite], rtol=1e-6, atol=1e-6)
