"""Newton-Schulz kernels: spectrum after 5 steps, lower-side iteration, precision, batching, FLOP count."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distsparse.optim import COEFFICIENT_SETS, newton_schulz, ns_flops

# Reference tables copied from their sources, not from the module under test.
# Polar Express, 5 iterations, safety 2e-2, cushion 2 (arXiv 2505.16932; karpathy/nanochat:nanochat/optim.py).
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
KJ_QUINTIC = [(3.4445, -4.7750, 2.0315)] * 5   # KellerJordan/Muon:muon.py
REFERENCE = {"polar_express": (POLAR_EXPRESS, 1.01), "kj_quintic": (KJ_QUINTIC, 1.0)}


def reference_ns(G: torch.Tensor, coefficients: str, eps: float = 1e-7) -> torch.Tensor:
    """Float64 quintic NS written from paper s3.2, on the wide orientation of one matrix."""
    table, scale = REFERENCE[coefficients]
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (scale * X.norm() + eps)
    for a, b, c in table:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def with_spectrum(m: int, n: int, ratio: float, seed: int) -> torch.Tensor:
    """U S V^T with singular values log-spaced from 1 down to `ratio`."""
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, r, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, r, dtype=torch.float64, generator=g))
    S = torch.logspace(0.0, torch.log10(torch.tensor(ratio)).item(), r, dtype=torch.float64)
    return ((U * S) @ V.T).float()


BOUNDS = {"polar_express": (0.85, 1.15), "kj_quintic": (0.6, 1.25)}


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("coefficients", ["polar_express", "kj_quintic"])
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("ratio", [1e-1, 1e-2])
def test_singular_values_after_five_steps_lie_in_the_documented_band(shape, coefficients, compute_dtype, ratio):
    G = with_spectrum(*shape, ratio, seed=shape[0] + shape[1])
    out = newton_schulz(G, steps=5, coefficients=coefficients, compute_dtype=compute_dtype)
    sv = torch.linalg.svdvals(out.double())
    low, high = BOUNDS[coefficients]
    assert low <= sv.min().item() and sv.max().item() <= high, (sv.min().item(), sv.max().item())


@pytest.mark.parametrize("coefficients", ["polar_express", "kj_quintic"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
def test_fp32_iteration_equals_a_float64_reference_loop(shape, coefficients):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out = newton_schulz(G, coefficients=coefficients, compute_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference_ns(G, coefficients), rtol=0, atol=2e-5)


def test_wide_and_tall_inputs_give_transposed_results():
    # Equal to float32 round-off, not bit for bit: which BLAS kernel (and summation order) a matmul of a transposed
    # layout gets depends on the CPU (bit-identical on the machines before 2026-12-03, 9e-7 apart on this one).
    G = torch.randn(24, 56, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(newton_schulz(G.T.contiguous()), newton_schulz(G).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)], ids=["tall", "wide"])
def test_the_iteration_runs_on_the_lower_dimensional_side(shape):
    """Matmul FLOPs equal steps * (4 s^2 l + 2 s^3) with s = min; on the large side they would be ~9x more."""
    G = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        newton_schulz(G, steps=5)
    assert counter.get_total_flops() == ns_flops(*shape, steps=5) == 5 * (4 * 32 ** 2 * 96 + 2 * 32 ** 3)


def test_batched_matrices_equal_one_call_per_matrix():
    G = torch.randn(3, 20, 36, generator=torch.Generator().manual_seed(3))
    G[1] = G[1] * 1e3    # per-matrix normalization: scale of one matrix must not leak into another
    batched = newton_schulz(G)
    for i in range(3):
        torch.testing.assert_close(batched[i], newton_schulz(G[i]), rtol=0, atol=1e-5)


def test_cpu_default_iterates_in_fp32_and_returns_the_input_dtype():
    G = torch.randn(16, 40, generator=torch.Generator().manual_seed(4))
    assert torch.equal(newton_schulz(G), newton_schulz(G, compute_dtype=torch.float32))
    low = newton_schulz(G, compute_dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and not torch.equal(low, newton_schulz(G))
    assert newton_schulz(G.bfloat16()).dtype == torch.bfloat16


def test_normalization_is_done_in_fp32_so_fp16_inputs_whose_norm_overflows_fp16_still_work():
    G = (torch.randn(16, 40, generator=torch.Generator().manual_seed(5)) * 300).half()
    assert not torch.isfinite(G.square().sum())    # the norm computed in fp16 would be inf
    out = newton_schulz(G, compute_dtype=torch.float16)
    assert torch.isfinite(out).all()
    sv = torch.linalg.svdvals(out.double())
    assert 0.5 < sv.min().item() and sv.max().item() < 1.3


def test_zero_matrix_stays_zero():
    assert torch.equal(newton_schulz(torch.zeros(8, 12)), torch.zeros(8, 12))


def test_ns_flops_is_symmetric_and_matches_design_formula():
    assert ns_flops(512, 1376) == ns_flops(1376, 512) == 5 * (4 * 512 ** 2 * 1376 + 2 * 512 ** 3)
    assert ns_flops(64, 64, steps=1) == 6 * 64 ** 3


def test_coefficient_sets_are_named_and_bad_requests_name_the_argument():
    assert set(COEFFICIENT_SETS) == {"polar_express", "kj_quintic"}
    with pytest.raises(ValueError, match="coefficients: got 'cubic'"):
        newton_schulz(torch.randn(4, 4), coefficients="cubic")
    with pytest.raises(ValueError, match="steps: got 6 for coefficients 'polar_express'"):
        newton_schulz(torch.randn(4, 4), steps=6)
    assert newton_schulz(torch.randn(4, 8), steps=7, coefficients="kj_quintic").shape == (4, 8)
    with pytest.raises(ValueError, match="G: expected"):
        newton_schulz(torch.randn(4))


@pytest.mark.parametrize("compute_dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)], ids=["wide", "tall", "square"])
def test_kept_values_scattered_and_pre_normalized_equal_tans_x0_then_a_float64_reference(shape, compute_dtype, atol):
    # The matrix engine's sparse-group call (group_rules._geometry): G is each matrix's kept values [k, r, c] (one
    # norm per matrix), TANS's X0 = U / (||U|| + eps) taken on the values, `scatter` builds the dense frame.
    # Reference: the dense U built here, X0 by the formula, then the float64 loop. One matrix of the batch has a norm
    # near eps, where a normalization dropping eps is wrong by orders of magnitude.
    m, n = shape
    gen = torch.Generator().manual_seed(m * n)
    kept = n // 4   # per row of the frame, at random columns: the values [k, m, kept] are matrices too
    mask = torch.zeros(m, n, dtype=torch.bool).scatter_(1, torch.rand(m, n, generator=gen).argsort(1)[:, :kept], True)
    values = torch.randn(3, m, kept, generator=gen)
    values[1] *= 1e-7
    values[2] *= 1e3

    def scatter(v):
        dense = v.new_zeros(v.shape[0], m, n)
        dense[:, mask] = v.reshape(v.shape[0], -1)   # row-major: each row's values at its ascending columns
        return dense

    pre_eps = 1e-8
    x0_values = values / (torch.linalg.matrix_norm(values, keepdim=True) + pre_eps)
    out = newton_schulz(x0_values, coefficients="polar_express", compute_dtype=compute_dtype, scatter=scatter)
    assert out.shape == (3, m, n) and out.dtype == compute_dtype   # the dense frame, left in the compute dtype
    for i in range(3):
        u = scatter(values[i:i + 1].double())[0]
        x0 = u / (u.norm() + pre_eps)
        torch.testing.assert_close(out[i].double(), reference_ns(x0, "polar_express"), rtol=0, atol=atol)
