"""TANS on CUDA (issue 4 item 5; run by tools/gpu_check.sh): bf16 Newton-Schulz iterations, and steps that equal
the CPU fp32 steps within bf16 tolerance (DESIGN decision 7: NS normalized in fp32, iterated in bf16 on GPU).

Both sides start from the same fp32 master and state and get the same bf16-representable gradients, so the only
difference is the bf16 rounding inside Newton-Schulz (and, for the engine, bf16 values and gradients of the layer):
within a few bf16 ulps (2^-8 relative) of the update's scale, compounded over 5 iterations.
"""

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

from distsparse.layers import NMSparseLinear
from distsparse.nm import NMSpec, encode, kept_index, random_mask
from distsparse.optim import TansHParams, init_state, newton_schulz, step_tans
from distsparse.optim.engine import MatrixEngine

pytestmark = pytest.mark.gpu

SPECS = [NMSpec(n, 4, layout) for n in (1, 2) for layout in ("row", "block")]
MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm, torch.baddbmm,
           torch.addmm}
# ramp 0: the NS correction is active from the first step, so every step below exercises the bf16 iterations.
HP = TansHParams(lr=1e-2, ramp_steps=0)
DEVICE = "cuda"


class MatmulDtypes(TorchFunctionMode):
    """Records the dtypes of every matrix product issued while active (the NS iterations are only products)."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.dtypes.append({a.dtype for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().double().cpu()
    want = want.detach().double().cpu()
    return float((got - want).norm() / want.norm())


def test_newton_schulz_on_cuda_iterates_in_bf16_and_returns_the_input_dtype():
    x = torch.randn(3, 96, 160, generator=torch.Generator().manual_seed(0))
    with MatmulDtypes() as mode:
        out = newton_schulz(x.to(DEVICE))
    # 5 iterations x 3 products (X X^T, A A, B X), every one on bf16 operands.
    assert len(mode.dtypes) == 15 and all(d == {torch.bfloat16} for d in mode.dtypes), mode.dtypes
    assert out.dtype == torch.float32 and out.device.type == DEVICE
    # bf16 iterations from a random start: about 4% from the fp32 result (measured with bf16 products on CPU).
    assert relative_error(out, newton_schulz(x)) < 0.1


@pytest.mark.parametrize("spec", SPECS + [None], ids=lambda s: "dense" if s is None else str(s))
def test_tans_steps_on_cuda_equal_the_cpu_fp32_steps_within_bf16_tolerance(spec):
    out_features, in_features = 192, 128
    gen = torch.Generator().manual_seed(1)
    if spec is None:
        index, k = None, in_features
    else:
        index, k = kept_index(encode(random_mask(out_features, in_features, spec, gen), spec)), in_features * spec.n // 4
    master = torch.randn(out_features, k, generator=gen) * 0.02
    cpu_master, gpu_master = master.clone(), master.to(DEVICE, copy=True)
    cpu_state, gpu_state = init_state("tans", (out_features, k)), init_state("tans", (out_features, k), DEVICE)
    gpu_index = None if index is None else index.to(DEVICE)
    for _ in range(4):
        grad = (torch.randn(out_features, k, generator=gen) * 1e-3).bfloat16().float()
        step_tans(cpu_master, grad, cpu_state, lr=HP.lr, hp=HP, index=index, shape=(out_features, in_features))
        step_tans(gpu_master, grad.to(DEVICE), gpu_state, lr=HP.lr, hp=HP, index=gpu_index,
                  shape=(out_features, in_features))
    assert gpu_master.dtype == torch.float32 and gpu_state["V"].device.type == DEVICE
    assert int(gpu_state["tau"]) == int(cpu_state["tau"]) == 4
    # V and P never pass through NS: fp32 on both devices, equal up to fp32 rounding.
    torch.testing.assert_close(gpu_state["V"].cpu(), cpu_state["V"], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(gpu_state["P"].cpu(), cpu_state["P"], rtol=1e-5, atol=1e-8)
    # The weight moved by 4 steps whose NS half carries the bf16 error: 0.9-1.3% measured with bf16 products on CPU.
    assert relative_error(gpu_master - master.to(DEVICE), cpu_master - master) < 3e-2


def test_engine_step_of_a_bf16_layer_on_cuda_equals_the_fp32_cpu_step_within_bf16_tolerance():
    spec = NMSpec(2, 4, "row")
    cpu_layer = NMSparseLinear(128, 96, spec, seed=3)
    with torch.no_grad():
        cpu_layer.values.copy_(cpu_layer.values.bfloat16().float())
    gpu_layer = copy.deepcopy(cpu_layer).to(DEVICE, torch.bfloat16)
    start = cpu_layer.values.detach().clone()
    cpu_engine = MatrixEngine({"layer": cpu_layer}, rule="tans", hparams=HP)
    gpu_engine = MatrixEngine({"layer": gpu_layer}, rule="tans", hparams=HP)
    assert gpu_engine.masters["layer"].dtype == torch.float32, "the owner keeps an fp32 master of a bf16 layer"

    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        # d/dvalues of sum(values * g) is g exactly: both engines receive the same bf16-representable gradient
        # through the layer's post-accumulate hook (a real backward in bf16 would differ by its own rounding).
        grad = (torch.randn(cpu_layer.values.shape, generator=gen) * 1e-3).bfloat16()
        (cpu_layer.values * grad.float()).sum().backward()
        (gpu_layer.values * grad.to(DEVICE)).sum().backward()
        for engine in (cpu_engine, gpu_engine):
            engine.reduce_gradients()
            engine.step(HP.lr)
            engine.zero_grad()
    assert gpu_layer.values.dtype == torch.bfloat16 and gpu_layer.values.grad is None
    assert relative_error(gpu_engine.masters["layer"] - start.to(DEVICE), cpu_engine.masters["layer"] - start) < 3e-2
    # The bf16 weights the layer computes with are the fp32 master rounded once.
    assert torch.equal(gpu_layer.values, gpu_engine.masters["layer"].bfloat16())


def test_a_group_whose_ramps_differ_steps_on_cuda_like_on_the_cpu_and_syncs_nothing():
    """Four same-shape matrices, one group: tau 0..3 (ramp 8) makes gamma a [k, 1, 1] tensor copied to the device;
    the kept-index cache, the stacked NS and the gather run on CUDA, with no host sync in a steady step."""
    from distsparse.op_count import count_ops
    spec, hp = NMSpec(1, 4, "row"), TansHParams(lr=1e-2)
    cpu_layers = {f"m{i}": NMSparseLinear(128, 64, spec, seed=i) for i in range(4)}
    gpu_layers = {n: copy.deepcopy(m).to(DEVICE) for n, m in cpu_layers.items()}
    engines = [MatrixEngine(layers, rule="tans", hparams=hp) for layers in (cpu_layers, gpu_layers)]
    for engine in engines:
        engine.load_state_dict({n: {"master": m.values.detach().clone(), **init_state("tans", tuple(m.values.shape)),
                                    "tau": torch.tensor(i, dtype=torch.int64)}
                                for i, (n, m) in enumerate(sorted(cpu_layers.items()))})
    assert len(engines[1].groups) == 1 and engines[1].groups[0].index.is_cuda
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        grads = {n: torch.randn(m.values.shape, generator=gen) * 1e-3 for n, m in cpu_layers.items()}
        for engine in engines:
            engine.start_boundary()
            for n, g in grads.items():
                engine.grads.add(n, g.to(engine.device))
            engine.reduce_gradients()
        engines[0].step(hp.lr)
        counts, _ = count_ops(lambda: engines[1].step(hp.lr))
        if step > 0:   # the first step builds the index cache
            assert counts.syncs == 0, counts.sync_ops
        torch.cuda.synchronize()
        for engine in engines:
            engine.zero_grad()
    for n, m in cpu_layers.items():
        start = NMSparseLinear(128, 64, spec, seed=int(n[1:])).values.detach()
        assert relative_error(gpu_layers[n].values - start.to(DEVICE), m.values - start) < 3e-2, n
