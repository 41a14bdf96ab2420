"""NMSparseLinear in bf16 on CUDA against the same layer in fp32 on CPU (issue 2; run by tools/gpu_check.sh).

Both sides get the same bf16-representable values, input and output gradient, so the difference is only the bf16
rounding of the GEMMs' inputs and results: within a few bf16 ulps (2^-8 relative) of each tensor's scale.
"""

import copy

import pytest
import torch

from distsparse.layers import NMSparseLinear
from distsparse.nm import (
    NMSpec, decode, encode, gather_groups, gather_kept, kept_index, kept_positions, random_mask, scatter_groups,
    scatter_kept,
)

pytestmark = pytest.mark.gpu

SPECS = [NMSpec(n, 4, layout) for n in (1, 2) for layout in ("row", "block")]
ALL_SPECS = [NMSpec(n, 4, layout) for n in (1, 2, 3) for layout in ("row", "block")]


def assert_close_at_bf16_scale(got, want, name):
    got = got.float().cpu()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= 2e-2 * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_bf16_cuda_forward_and_grads_match_fp32_cpu(spec):
    cpu = NMSparseLinear(512, 256, spec, bias=True, seed=5)
    with torch.no_grad():
        cpu.values.copy_(cpu.values.bfloat16().float())
        cpu.bias.copy_(torch.randn(256).bfloat16().float())
    gpu = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    assert gpu.codes.dtype == torch.uint8 and gpu.index.device.type == "cuda"

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 512, generator=gen).bfloat16().float().requires_grad_(True)
    grad_y = torch.randn(4, 64, 256, generator=gen).bfloat16().float()
    x_gpu = x.detach().to("cuda", torch.bfloat16).requires_grad_(True)

    y = cpu(x)
    y.backward(grad_y)
    y_gpu = gpu(x_gpu)
    y_gpu.backward(grad_y.to("cuda", torch.bfloat16))

    assert y_gpu.dtype == torch.bfloat16 and gpu.values.grad.dtype == torch.bfloat16
    assert_close_at_bf16_scale(y_gpu, y.detach(), "output")
    assert_close_at_bf16_scale(x_gpu.grad, x.grad, "grad_x")
    assert_close_at_bf16_scale(gpu.values.grad, cpu.values.grad, "grad_values")
    assert_close_at_bf16_scale(gpu.bias.grad, cpu.bias.grad, "grad_bias")
    assert torch.equal(decode(gpu.meta).cpu(), decode(cpu.meta))


def test_a_layer_built_on_meta_materializes_on_cuda_like_on_cpu():
    spec = NMSpec(2, 4, "block")
    cpu = NMSparseLinear(64, 32, spec, seed=9)
    lazy = NMSparseLinear(64, 32, spec, seed=9, device="meta")
    lazy.to_empty(device="cuda")
    lazy.reset_parameters()
    assert torch.equal(lazy.codes.cpu(), cpu.codes)
    assert torch.equal(lazy.values.detach().cpu(), cpu.values.detach())


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
def test_the_group_lookup_on_cuda_gives_the_flat_index_results_bit_for_bit(spec):
    # The layer's path (lookup tables moved to the device, scatter / gather of groups) against the flat index path,
    # both on the GPU, and the positions against the CPU's.
    meta = encode(random_mask(64, 100 if spec.layout == "row" else 96, spec, torch.Generator().manual_seed(2)), spec)
    meta_gpu = type(meta)(meta.codes.cuda(), spec, meta.shape)
    pos = kept_positions(meta_gpu)
    assert pos.device.type == "cuda" and torch.equal(pos.cpu(), kept_positions(meta))
    values = torch.randn(meta.shape[0], meta.kept_per_row, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(meta.shape, device="cuda", dtype=torch.bfloat16)
    index = kept_index(meta_gpu)
    assert torch.equal(scatter_groups(values, pos, meta.shape), scatter_kept(values, index, meta.shape))
    assert torch.equal(gather_groups(dense, pos, meta.kept_per_row), gather_kept(dense, index, meta.kept_per_row))
