"""Per-matrix update rules against float64 references written from the papers' equations, and torch.optim."""

import dataclasses
import math

import pytest
import torch

from distsparse.nm import NMSpec, encode, kept_index, random_mask, scatter_kept
from distsparse.optim import (
    RULES, AdamHParams, AdamSHParams, MuonHParams, TansHParams, init_state, newton_schulz, step_adam, step_adams,
    step_adamw, step_muon, step_tans,
)

POLAR_EXPRESS = [   # arXiv 2505.16932 via karpathy/nanochat:nanochat/optim.py
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
KJ_QUINTIC = [(3.4445, -4.7750, 2.0315)] * 5
NS_TABLES = {"polar_express": (POLAR_EXPRESS, 1.01), "kj_quintic": (KJ_QUINTIC, 1.0)}


def ns64(X: torch.Tensor, coefficients: str, eps: float = 1e-7) -> torch.Tensor:
    """Float64 quintic NS (paper s3.2), on the lower-dimensional side, with the kernel's own normalization."""
    table, scale = NS_TABLES[coefficients]
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (scale * X.norm() + eps)
    for a, b, c in table:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def sparse_case(shape, n, layout, seed):
    """(mask [out, in] bool, flat kept index, k) of a random legal pattern."""
    spec = NMSpec(n, 4, layout)
    mask = random_mask(*shape, spec, generator=torch.Generator().manual_seed(seed))
    return mask, kept_index(encode(mask, spec)), spec.kept_per_row(shape[1])


def grads(shape, num_steps, seed):
    g = torch.Generator().manual_seed(seed)
    # Scales vary across steps so that V, P and the RMS ratio are exercised away from a fixed point.
    return [torch.randn(shape, generator=g, dtype=torch.float64) * (0.5 + t) for t in range(num_steps)]


# ---------------------------------------------------------------- TANS


def rms_scale64(U, OM, O, M, rms_mode, eps):
    """s of DESIGN s5's RMS modes in float64: RMS(U) / RMS(O_M) over the active entries, or over all entries."""
    active = M.sum()
    if rms_mode == "post_mask_active":
        return (U.square().sum() / active).sqrt() / ((OM.square().sum() / active).sqrt() + eps)
    if rms_mode == "pre_mask_global":
        return U.square().mean().sqrt() / (O.square().mean().sqrt() + eps)
    return 1.0


def tans_reference(theta, gs, mask, hp: TansHParams, lr, shape):
    """DESIGN s5 / paper s3.2 in float64 on the dense frame, with tau = 0, 1, 2, ... (no refresh in between)."""
    M = mask.double()
    V = torch.zeros(shape, dtype=torch.float64)
    P = torch.zeros(shape, dtype=torch.float64)
    b1, b2, eps = hp.beta1, hp.beta2, hp.eps
    for tau, G in enumerate(gs):
        t = tau + 1
        G = G * M
        V = b2 * V + (1 - b2) * G ** 2
        V_used = V / (1 - b2 ** t) if hp.bias_correction else V
        if hp.geometry_only:
            # NS of the raw masked momentum, scaled to the RMS of that momentum preconditioned by V.
            P = b1 * P + (1 - b1) * G
            P_used = P / (1 - b1 ** t) if hp.bias_correction else P
            U = M * ((1 - b1) * G + b1 * P_used)
            O = ns64(U / (U.norm() + eps), hp.ns_coefficients)
            U_final = rms_scale64(U / (V_used.sqrt() + eps), M * O, O, M, hp.rms_mode, eps) * M * O
        else:
            Gh = G / (V_used.sqrt() + eps)
            P = b1 * P + (1 - b1) * Gh
            P_used = P / (1 - b1 ** t) if hp.bias_correction else P
            U = M * ((1 - b1) * Gh + b1 * P_used)
            X0 = U / (U.norm() + eps)
            O = ns64(X0, hp.ns_coefficients)
            OM = M * O
            s = rms_scale64(U, OM, O, M, hp.rms_mode, eps)
            gamma = hp.gamma_ns * (min(1.0, tau / hp.ramp_steps) if hp.ramp_steps else 1.0)
            U_final = U + gamma * (s * OM - U)
        theta = (1 - lr * hp.weight_decay) * theta - lr * math.sqrt(shape[0] / shape[1]) * U_final
    return theta


def run_rule(step, hp, theta, gs, index, k, lr, rule, **extra):
    """Run `step` on compressed fp32 values for every gradient; returns the final dense fp32 master."""
    shape = tuple(theta.shape)
    if index is None:
        master = theta.float().clone()
    else:
        master = theta.float().reshape(-1)[index].view(shape[0], k).clone()
    state = init_state(rule, tuple(master.shape))
    for G in gs:
        grad = G.float() if index is None else G.float().reshape(-1)[index].view(shape[0], k)
        step(master, grad, state, lr=lr, hp=hp, index=index, shape=shape, **extra)
    return (master if index is None else scatter_kept(master, index, shape)), state


TANS_SHAPES = {"row": ((16, 24), 1), "block": ((24, 16), 2)}   # wide 1:4 row-wise, tall 2:4 block-wise


@pytest.mark.parametrize("ramp_steps", [0, 3])
@pytest.mark.parametrize("rms_mode", ["none", "pre_mask_global", "post_mask_active"])
@pytest.mark.parametrize("layout", ["row", "block"])
def test_tans_equals_the_float64_reference_from_design_s5(layout, rms_mode, ramp_steps):
    shape, n = TANS_SHAPES[layout]
    mask, index, k = sparse_case(shape, n, layout, seed=11)
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12)) * mask
    gs = grads(shape, 6, seed=13)           # tau runs 0..5: base only, ramp up, full correction
    hp = TansHParams(rms_mode=rms_mode, ramp_steps=ramp_steps, weight_decay=0.1)
    got, state = run_rule(step_tans, hp, theta, gs, index, k, lr=0.05, rule="tans")
    want = tans_reference(theta, gs, mask, hp, 0.05, shape)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    assert int(state["tau"]) == 6 and int(state["step"]) == 6
    assert not torch.equal(got.double(), tans_reference(theta, gs, mask, dataclasses.replace(hp, gamma_ns=0.0),
                                                        0.05, shape))   # the NS correction did something


@pytest.mark.parametrize("variant", [
    dict(geometry_only=True),
    dict(geometry_only=True, rms_mode="none"),
    dict(geometry_only=True, rms_mode="pre_mask_global", bias_correction=True),
    dict(bias_correction=True),
    dict(gamma_ns=0.0),
    dict(gamma_ns=1.0, ns_coefficients="kj_quintic"),
], ids=["geometry_only", "geometry_only_unscaled", "geometry_only_global_bias_corrected", "bias_correction",
         "base_only", "kj_full_correction"])
def test_tans_ablation_switches_equal_the_float64_reference(variant):
    shape, n = (20, 32), 2
    mask, index, k = sparse_case(shape, n, "row", seed=21)
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(22)) * mask
    gs = grads(shape, 5, seed=23)
    hp = TansHParams(ramp_steps=2, **variant)
    got, _ = run_rule(step_tans, hp, theta, gs, index, k, lr=0.05, rule="tans")
    torch.testing.assert_close(got.double(), tans_reference(theta, gs, mask, hp, 0.05, shape), rtol=0, atol=2e-5)


def _torch_adam64(theta, gs, lr, betas, eps):
    """torch.optim.Adam in float64 (bias-corrected, no decay): an implementation of Adam's equations of its own."""
    p = theta.clone().requires_grad_(True)
    opt = torch.optim.Adam([p], lr=lr, betas=betas, eps=eps, foreach=False)
    for G in gs:
        p.grad = G.clone()
        opt.step()
    return p.detach()


def test_bias_corrected_tans_base_update_follows_adams_equations_for_three_steps():
    """Base update only (gamma_ns 0), dense 4 x 6, lr 0.05, 3 steps. Adam's equations in float64:
    v = b2 v + (1-b2) g^2, v^ = v / (1-b2^t), gh = g / (sqrt(v^) + eps); m = b1 m + (1-b1) gh, m^ = m / (1-b1^t);
    U = (1-b1) gh + b1 m^ (TANS's Nesterov form), theta -= lr sqrt(out/in) U. With b1 = 0 that is Adam itself
    (torch.optim.Adam, betas (0, b2)); with any b1 the first step is Adam's first step, g / (|g| + eps)."""
    shape, lr, eps = (4, 6), 0.05, 1e-5
    fan = math.sqrt(shape[0] / shape[1])
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(41))
    gs = grads(shape, 3, seed=42)
    for b1, b2 in ((0.9, 0.999), (0.0, 0.95)):
        hp = TansHParams(bias_correction=True, gamma_ns=0.0, beta1=b1, beta2=b2, eps=eps)
        got, state = run_rule(step_tans, hp, theta, gs, None, None, lr=lr, rule="tans")
        want, m, v = theta.clone(), torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        for t, g in enumerate(gs, start=1):
            v = b2 * v + (1 - b2) * g * g
            gh = g / ((v / (1 - b2 ** t)).sqrt() + eps)
            m = b1 * m + (1 - b1) * gh
            want = want - lr * fan * ((1 - b1) * gh + b1 * m / (1 - b1 ** t))
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
        assert int(state["step"]) == 3
        first, _ = run_rule(step_tans, hp, theta, gs[:1], None, None, lr=lr, rule="tans")
        torch.testing.assert_close(first.double(), _torch_adam64(theta, gs[:1], lr * fan, (0.9, b2), eps),
                                   rtol=0, atol=1e-6)
        if b1 == 0.0:
            torch.testing.assert_close(got.double(), _torch_adam64(theta, gs, lr * fan, (0.0, b2), eps),
                                       rtol=0, atol=1e-6)
        # The paper's TANS (no correction) steps differently: the correction is what these numbers measure.
        plain, _ = run_rule(step_tans, dataclasses.replace(hp, bias_correction=False), theta, gs, None, None, lr=lr,
                            rule="tans")
        assert (plain.double() - want).abs().max() > 1e-3


def test_dense_tans_with_no_index_equals_the_reference_with_a_mask_of_ones():
    shape = (12, 20)
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(31))
    gs = grads(shape, 4, seed=32)
    hp = TansHParams(ramp_steps=2)
    got, _ = run_rule(step_tans, hp, theta, gs, None, None, lr=0.05, rule="tans")
    want = tans_reference(theta, gs, torch.ones(shape, dtype=torch.bool), hp, 0.05, shape)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


def test_tans_first_step_after_a_refresh_is_the_pure_base_update():
    shape, n = (16, 24), 2
    mask, index, k = sparse_case(shape, n, "row", seed=41)
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(42)) * mask
    gs = grads(shape, 1, seed=43)
    base, _ = run_rule(step_tans, TansHParams(gamma_ns=0.0), theta, gs, index, k, lr=0.05, rule="tans")
    tau0, _ = run_rule(step_tans, TansHParams(gamma_ns=1.0, ramp_steps=4), theta, gs, index, k, lr=0.05,
                       rule="tans")
    assert torch.equal(tau0, base)


def test_tans_never_writes_inactive_positions_although_ns_puts_mass_there():
    shape, n = (16, 24), 1
    mask, index, k = sparse_case(shape, n, "row", seed=51)
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(52)) * mask
    gs = grads(shape, 4, seed=53)
    got, _ = run_rule(step_tans, TansHParams(ramp_steps=0, gamma_ns=1.0), theta, gs, index, k, lr=0.05,
                      rule="tans")
    assert torch.count_nonzero(got[~mask]) == 0 and torch.count_nonzero(got[mask]) == int(mask.sum())
    ns_off_mask = newton_schulz((gs[0] * mask).float())[~mask]
    assert ns_off_mask.abs().max() > 1e-2   # so the projection to the mask is doing real work


# ---------------------------------------------------------------- Muon


def muon_reference(theta, gs, mask, hp: MuonHParams, lr, shape):
    """KellerJordan/Muon muon_update on the masked gradient, float64, projected to the mask."""
    M = mask.double()
    mom = torch.zeros(shape, dtype=torch.float64)
    b = hp.momentum
    for G in gs:
        G = G * M
        mom = b * mom + (1 - b) * G
        U = (1 - b) * G + b * mom if hp.nesterov else mom
        O = ns64(U, hp.ns_coefficients)
        theta = (1 - lr * hp.weight_decay) * theta - lr * max(1.0, shape[0] / shape[1]) ** 0.5 * (M * O)
    return theta


@pytest.mark.parametrize("case", [
    dict(layout="row", shape=(16, 32), n=1, nesterov=True, coefficients="polar_express"),
    dict(layout="block", shape=(32, 16), n=2, nesterov=False, coefficients="kj_quintic"),
    dict(layout=None, shape=(24, 12), n=None, nesterov=True, coefficients="polar_express"),
], ids=["row-1of4-wide-nesterov", "block-2of4-tall-plain", "dense-tall"])
def test_muon_equals_an_independent_float64_reference(case):
    shape = case["shape"]
    if case["layout"] is None:
        mask, index, k = torch.ones(shape, dtype=torch.bool), None, None
    else:
        mask, index, k = sparse_case(shape, case["n"], case["layout"], seed=61)
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(62)) * mask
    gs = grads(shape, 4, seed=63)
    hp = MuonHParams(nesterov=case["nesterov"], ns_coefficients=case["coefficients"], weight_decay=0.1)
    got, _ = run_rule(step_muon, hp, theta, gs, index, k, lr=0.02, rule="muon")
    torch.testing.assert_close(got.double(), muon_reference(theta, gs, mask, hp, 0.02, shape), rtol=0, atol=2e-6)


# ---------------------------------------------------------------- Adam family


@pytest.mark.parametrize("rule,step,torch_cls,weight_decay", [
    ("adam", step_adam, torch.optim.Adam, 0.0), ("adam", step_adam, torch.optim.Adam, 0.1),
    ("adamw", step_adamw, torch.optim.AdamW, 0.1),
])
def test_adam_and_adamw_equal_torch_optim_on_the_compressed_values(rule, step, torch_cls, weight_decay):
    g = torch.Generator().manual_seed(71)
    values = torch.randn(8, 6, generator=g)
    param = torch.nn.Parameter(values.clone())
    opt = torch_cls([param], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    master, state = values.clone(), init_state(rule, (8, 6))
    hp = AdamHParams(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay)
    for _ in range(5):
        grad = torch.randn(8, 6, generator=g)
        param.grad = grad.clone()
        opt.step()
        step(master, grad, state, lr=0.01, hp=hp, index=None, shape=(8, 12))
    torch.testing.assert_close(master, param.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"], opt.state[param]["exp_avg_sq"], rtol=1e-6, atol=0)
    assert int(state["step"]) == 5


def test_adams_equals_the_float64_reference_and_decays_only_pruned_coordinates():
    shape = (8, 16)
    mask = random_mask(*shape, NMSpec(2, 4, "row"), generator=torch.Generator().manual_seed(81))
    theta = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(82))
    gs = grads(shape, 4, seed=83)
    hp = AdamSHParams(lambda_w=0.05, weight_decay=0.1)
    lr, b1, b2, eps = 0.01, hp.beta1, hp.beta2, hp.eps
    m = torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape, dtype=torch.float64)
    want = theta.clone()
    for t, G in enumerate(gs, start=1):     # AST adamw.py structure, L1 decay on the pruned set
        want = want * (1 - lr * hp.weight_decay)
        m = b1 * m + (1 - b1) * G
        u = m + hp.lambda_w * torch.sign(want) * (~mask).double()
        v = b2 * v + (1 - b2) * u ** 2
        want = want - lr / (1 - b1 ** t) * u / ((v / (1 - b2 ** t)).sqrt() + eps)
    got, _ = run_rule(step_adams, hp, theta, gs, None, None, lr=lr, rule="adams", mask=mask)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    no_decay, _ = run_rule(step_adams, dataclasses.replace(hp, lambda_w=0.0), theta, gs, None, None, lr=lr,
                           rule="adams", mask=mask)
    assert torch.equal(got[mask], no_decay[mask]) and not torch.equal(got[~mask], no_decay[~mask])


# ---------------------------------------------------------------- registry and hyperparameters


def test_every_registered_rule_runs_from_init_state_and_fills_its_declared_keys():
    shape, n = (8, 16), 2
    mask, index, k = sparse_case(shape, n, "row", seed=91)
    for name, rule in RULES.items():
        dense = name == "adams"
        master = torch.randn(shape) if dense else torch.randn(shape[0], k)
        state = init_state(name, tuple(master.shape))
        assert set(state) == set(rule.state_keys)
        assert all(state[key].dtype == torch.float32 and state[key].shape == master.shape for key in rule.slot_keys)
        assert all(state[key].dim() == 0 and state[key].device.type == "cpu" for key in rule.counter_keys)
        extra = dict(mask=mask) if dense else {}
        rule.step(master, torch.randn_like(master), state, lr=1e-3, hp=rule.hparams(),
                  index=None if dense else index, shape=shape, **extra)
        assert all(bool(state[key].abs().sum() > 0) for key in rule.slot_keys), name


def test_hparams_defaults_follow_app_h5_and_bad_values_name_the_field():
    hp = TansHParams()
    assert (hp.lr, hp.eps, hp.beta1, hp.beta2, hp.weight_decay, hp.gamma_ns, hp.ramp_steps) == \
        (1e-3, 1e-5, 0.9, 0.999, 0.0, 0.5, 8)
    assert (hp.rms_mode, hp.ns_coefficients, hp.ns_steps, hp.bias_correction) == \
        ("post_mask_active", "polar_express", 5, False)
    with pytest.raises(ValueError, match="rms_mode: got 'global'; allowed: none, pre_mask_global"):
        TansHParams(rms_mode="global")
    with pytest.raises(ValueError, match="ns_steps: got 6 for ns_coefficients 'polar_express'"):
        TansHParams(ns_steps=6)
    with pytest.raises(ValueError, match="ns_coefficients: got 'x'"):
        MuonHParams(ns_coefficients="x")
    with pytest.raises(ValueError, match="beta1: got 1.0"):
        AdamHParams(beta1=1.0)
    with pytest.raises(ValueError, match="ramp_steps: got -1"):
        TansHParams(ramp_steps=-1)
    with pytest.raises(ValueError, match="lambda_w: got -0.1"):
        AdamSHParams(lambda_w=-0.1)
