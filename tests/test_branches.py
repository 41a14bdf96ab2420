"""Auxiliary branches: CoMoLoRA, LoRA, Add+Align, Prod-Gate against formulas written from the paper, and the budget."""

import math

import pytest
import torch
import torch.nn as nn

from distsparse.layers.branches import (
    AddAlignBranch, CoMoLoRABranch, LoRABranch, ProdGateBranch, branch_params, build_branch, foldable,
    mean_aux_loss, rank_for_budget,
)

F64 = torch.float64


def _randomize_factors(branch: LoRABranch, gen: torch.Generator) -> None:
    with torch.no_grad():
        branch.lora_A.copy_(torch.randn(branch.lora_A.shape, generator=gen, dtype=F64))
        branch.lora_B.copy_(torch.randn(branch.lora_B.shape, generator=gen, dtype=F64))


def _gate_ref(x, w1, b1, w2, b2, gamma):
    """1 + gamma tanh(W2 SiLU(W1 x + b1) + b2), App. D.5, in float64."""
    h = x @ w1.T + b1
    return 1.0 + gamma * torch.tanh((h * torch.sigmoid(h)) @ w2.T + b2)


def test_comolora_equals_lora_at_init_with_random_factors_and_is_nonzero():
    gen = torch.Generator().manual_seed(0)
    como = CoMoLoRABranch(12, 8, rank=3, hidden=2, gamma=0.5, alpha=6.0, dtype=F64)
    lora = LoRABranch(12, 8, rank=3, alpha=6.0, dtype=F64)
    _randomize_factors(como, gen)
    with torch.no_grad():
        lora.lora_A.copy_(como.lora_A)
        lora.lora_B.copy_(como.lora_B)
    x = torch.randn(5, 12, generator=gen, dtype=F64)
    y_s = torch.randn(5, 8, generator=gen, dtype=F64)
    ref = y_s + (6.0 / 3) * (x @ como.lora_A.T) @ como.lora_B.T
    out_como, out_lora = como(x, y_s), lora(x, y_s)
    torch.testing.assert_close(out_como, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_lora, ref, rtol=1e-12, atol=1e-12)
    assert (out_como - y_s).abs().min() > 0


def test_comolora_gate_departs_from_one_after_adamw_steps_and_follows_app_d5():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    como = CoMoLoRABranch(16, 8, rank=4, hidden=2, gamma=0.5, dtype=F64)
    _randomize_factors(como, gen)
    x = torch.randn(64, 16, generator=gen, dtype=F64)
    target = torch.randn(64, 8, generator=gen, dtype=F64)
    y_s = torch.zeros(64, 8, dtype=F64)
    assert torch.equal(como.modulation(x), torch.ones(64, 4, dtype=F64))
    opt = torch.optim.AdamW(como.parameters(), lr=1e-2)
    for _ in range(5):
        opt.zero_grad()
        ((como(x, y_s) - target) ** 2).mean().backward()
        opt.step()
    g = como.gate
    m_ref = _gate_ref(x, g.w1, g.b1, g.w2, g.b2, 0.5).detach()
    torch.testing.assert_close(como.modulation(x).detach(), m_ref, rtol=1e-12, atol=1e-12)
    assert (m_ref - 1).abs().max() > 1e-3
    assert m_ref.std(dim=0).max() > 1e-4      # input-dependent, not a constant rescaling
    out_ref = (m_ref * (x @ como.lora_A.T)) @ como.lora_B.T
    torch.testing.assert_close(como(x, y_s).detach(), out_ref, rtol=1e-12, atol=1e-12)


def test_prod_gate_is_identity_at_init_and_multiplies_the_sparse_output_after():
    gen = torch.Generator().manual_seed(2)
    gate = ProdGateBranch(12, 8, hidden=3, gamma=0.5, dtype=F64)
    x = torch.randn(5, 12, generator=gen, dtype=F64)
    y_s = torch.randn(5, 8, generator=gen, dtype=F64)
    assert torch.equal(gate(x, y_s), y_s)
    with torch.no_grad():
        gate.gate.w2.copy_(torch.randn(8, 3, generator=gen, dtype=F64))
        gate.gate.b2.copy_(torch.randn(8, generator=gen, dtype=F64))
    g = gate.gate
    ref = _gate_ref(x, g.w1, g.b1, g.w2, g.b2, 0.5) * y_s
    torch.testing.assert_close(gate(x, y_s), ref, rtol=1e-12, atol=1e-12)


def test_add_align_aux_loss_matches_hand_computation():
    gen = torch.Generator().manual_seed(3)
    branch = AddAlignBranch(10, 6, rank=2, align_weight=0.3, dtype=F64)
    _randomize_factors(branch, gen)
    x = torch.randn(2, 4, 10, generator=gen, dtype=F64)
    y_s = torch.randn(2, 4, 6, generator=gen, dtype=F64)
    out = branch(x, y_s)
    delta = (x @ branch.lora_A.T) @ branch.lora_B.T
    cosines = []
    for a, d in zip(y_s.reshape(-1, 6).tolist(), delta.reshape(-1, 6).tolist()):
        dot = sum(p * q for p, q in zip(a, d))
        cosines.append(dot / (math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in d))))
    expected = 0.3 * sum(1 - c for c in cosines) / len(cosines)
    assert branch.aux_loss().item() == pytest.approx(expected, rel=1e-6)   # the cosine runs in fp32
    torch.testing.assert_close(out, y_s + delta, rtol=1e-12, atol=1e-12)


def test_add_align_with_zero_branch_output_counts_cosine_zero_and_keeps_gradients_finite():
    gen = torch.Generator().manual_seed(4)
    branch = AddAlignBranch(10, 6, rank=2, align_weight=0.3)    # B = 0: the branch adds nothing at step 0
    x = torch.randn(7, 10, generator=gen)
    y_s = torch.randn(7, 6, generator=gen, requires_grad=True)
    branch(x, y_s)
    assert branch.aux_loss().item() == pytest.approx(0.3)
    branch.aux_loss().backward()
    for grad in (branch.lora_A.grad, branch.lora_B.grad, y_s.grad):
        assert grad is None or torch.isfinite(grad).all()


def test_lora_delta_weight_folds_into_the_backbone_weight():
    gen = torch.Generator().manual_seed(5)
    lora = LoRABranch(12, 8, rank=3, alpha=1.5, dtype=F64)
    _randomize_factors(lora, gen)
    weight = torch.randn(8, 12, generator=gen, dtype=F64)
    x = torch.randn(5, 12, generator=gen, dtype=F64)
    torch.testing.assert_close(lora(x, x @ weight.T), x @ (weight + lora.delta_weight()).T, rtol=1e-12, atol=1e-12)
    assert foldable("add") and foldable("add_align") and foldable("none")
    assert not foldable("como") and not foldable("prod_gate")


LLAMA_60M = (512, 1376, 8)    # hidden, FFN, layers (research/pretraining_ecosystem.md s1.1)


def _shapes(d: int, ff: int, layers: int) -> list[tuple[int, int]]:
    return ([(d, d)] * 4 + [(d, ff)] * 2 + [(ff, d)]) * layers     # q k v o, gate up, down: (in, out)


def test_llama_60m_at_one_percent_gives_rank_seven_counting_the_low_rank_factors_only():
    # LLaMA-60M, vocab 32000, untied embedding and head: 2 V d + L (4 d^2 + 3 d ff + 2 d) + d. HF LlamaForCausalLM
    # counts the same 58,073,600.
    d, ff, layers = LLAMA_60M
    dense = 2 * 32000 * d + layers * (4 * d * d + 3 * d * ff + 2 * d) + d
    assert dense == 58_073_600
    lora_per_rank = layers * (4 * (d + d) + 2 * (d + ff) + (ff + d))    # 78,080
    assert 7 * lora_per_rank <= 0.01 * dense < 8 * lora_per_rank       # 546,560 <= 580,736 < 624,640
    for kind in ("como", "add", "add_align"):
        assert rank_for_budget(kind, 1.0, dense, _shapes(*LLAMA_60M), hidden=2, counts="low_rank") == 7
    # The controller rides on top of that budget: 619,016 branch parameters in all at r = 7 (1.066%).
    controller = layers * (2 * (6 * d + ff + 7) + 7 * 7 * (2 + 1))   # per projection h (in + 1) + r (h + 1)
    como_total = sum(branch_params("como", i, o, 7, 2) for i, o in _shapes(*LLAMA_60M))
    assert como_total == 7 * lora_per_rank + controller == 619_016


def test_llama_60m_at_one_percent_counting_every_branch_parameter():
    # como r: 7 * 78,080 + controller(7) = 619,016 > 580,736; at r = 6: 6 * 78,080 + 8 (2 (6 d + ff + 7) + 6 * 7 * 3)
    # = 540,768 fits. prod_gate (whole gate either way) at width w: w (sum of in + 1 + out) + sum of out
    # = w * 78,136 + 42,496: 6 fits (511,312), 7 does not (589,448).
    d, ff, layers = LLAMA_60M
    dense = 58_073_600
    assert 6 * 78_080 + layers * (2 * (6 * d + ff + 7) + 6 * 7 * 3) == 540_768
    expected = {"add": 7, "add_align": 7, "como": 6, "prod_gate": 6}
    for kind, rank in expected.items():
        assert rank_for_budget(kind, 1.0, dense, _shapes(*LLAMA_60M), hidden=2) == rank
        assert rank_for_budget(kind, 1.0, dense, _shapes(*LLAMA_60M), hidden=2, counts="all") == rank
    assert rank_for_budget("prod_gate", 1.0, dense, _shapes(*LLAMA_60M), hidden=2, counts="low_rank") == 6


@pytest.mark.parametrize("counts", ["all", "low_rank"])
@pytest.mark.parametrize("kind", ["add", "add_align", "como", "prod_gate"])
def test_rank_for_budget_is_the_largest_rank_whose_budgeted_parameters_fit(kind, counts):
    shapes = [(32, 48), (48, 32), (32, 32)]
    dense = 200_000

    def budgeted(rank):   # counted from built modules on the meta device
        total = 0
        for i, o in shapes:
            branch = build_branch(kind, i, o, rank=rank, hidden=3, gamma=0.5, device="meta")
            low_rank_only = counts == "low_rank" and kind != "prod_gate"
            params = (branch.lora_A, branch.lora_B) if low_rank_only else branch.parameters()
            total += sum(p.numel() for p in params)
        return total

    rank = rank_for_budget(kind, 2.5, dense, shapes, hidden=3, counts=counts)
    assert budgeted(rank) <= 0.025 * dense < budgeted(rank + 1)


@pytest.mark.parametrize("kind", ["none", "add", "add_align", "como", "prod_gate"])
def test_branch_params_matches_the_built_module(kind):
    branch = build_branch(kind, 20, 12, rank=5, hidden=3, gamma=0.5, device="meta")
    assert branch_params(kind, 20, 12, 5, 3) == sum(p.numel() for p in branch.parameters())


def test_build_branch_rejects_unknown_kinds_naming_value_and_allowed():
    with pytest.raises(ValueError, match=r"'lora'.*none, add, add_align, prod_gate, como"):
        build_branch("lora", 8, 8, rank=2, hidden=2, gamma=0.5)
    with pytest.raises(ValueError, match="'lora'"):
        rank_for_budget("lora", 1.0, 1000, [(8, 8)], hidden=2)


def test_rank_for_budget_refuses_a_budget_below_rank_one_and_unknown_counts():
    with pytest.raises(ValueError, match="budget_percent.*0.001"):
        rank_for_budget("add", 0.001, 10_000, [(64, 64)], hidden=2)
    with pytest.raises(ValueError, match=r"budget_counts.*'factors'.*all, low_rank"):
        rank_for_budget("como", 1.0, 10_000, [(64, 64)], hidden=2, counts="factors")


def test_gate_last_layer_stays_zero_after_meta_materialization():
    model = nn.ModuleDict({"como": build_branch("como", 16, 8, rank=3, hidden=2, gamma=0.5, device="meta"),
                           "prod": build_branch("prod_gate", 16, 8, rank=3, hidden=2, gamma=0.5, device="meta")})
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for gate in (model["como"].gate, model["prod"].gate):
        assert not gate.w2.any() and not gate.b2.any() and gate.w1.abs().sum() > 0
    assert not model["como"].lora_B.any() and model["como"].lora_A.abs().sum() > 0


def test_mean_aux_loss_averages_the_align_branches_only():
    gen = torch.Generator().manual_seed(6)
    model = nn.ModuleList([AddAlignBranch(6, 4, rank=2, align_weight=w) for w in (0.1, 0.5)]
                          + [LoRABranch(6, 4, rank=2)])
    assert mean_aux_loss(model) is None
    x, y_s = torch.randn(3, 6, generator=gen), torch.randn(3, 4, generator=gen)
    for branch in model:
        branch(x, y_s)
    assert mean_aux_loss(model).item() == pytest.approx((0.1 + 0.5) / 2)   # B = 0: cosine counted as 0


# ---- the budget on built models ----------------------------------------------------------------------------

def _budget_case(preset: str, *overrides: str):
    from distsparse.config import load_config
    from distsparse.models import build_model, llama_config
    from transformers import LlamaForCausalLM
    cfg = load_config(None, ["model.preset=small", f"method.preset={preset}", *overrides])
    model = build_model(cfg.model, cfg.method, 64, seed=0)
    with torch.device("meta"):     # the budget's base: the same dense model at vocab 32000, counted by HF
        reference = LlamaForCausalLM(llama_config(cfg.model, 32000))
    return cfg, model, sum(p.numel() for p in reference.parameters())


def _branch_parameters(model: nn.Module, low_rank_only: bool) -> int:
    names = ("lora_A", "lora_B") if low_rank_only else ("",)
    return sum(p.numel() for n, p in model.named_parameters()
               if ".branch." in n and any(n.endswith(k) for k in names))


@pytest.mark.parametrize("preset, overrides", [
    ("chtsnm_add1_1of4_row", ()), ("chtsnm_add_align2_1of4_row", ()), ("chtsnm_como1_1of4_row", ()),
    ("chtsnm_como5_1of4_row", ()), ("chtsnm_prod_gate1_1of4_row", ()), ("chtsnm_1of4_row", ()),
    ("chtsnm_como2_1of4_row", ("model.tie_word_embeddings=true",)),
])
def test_built_branches_fill_their_budget_and_parameter_counts_report_the_share(preset, overrides):
    from distsparse.models import parameter_counts, sparsify
    from transformers import LlamaForCausalLM
    cfg, model, base = _budget_case(preset, *overrides)
    branch = cfg.method.branch
    low_rank_only = branch.budget_counts == "low_rank" and branch.kind != "prod_gate"
    budget = branch.budget_percent / 100 * base
    assert _branch_parameters(model, low_rank_only) <= budget
    # One rank more would not fit: the budget picks the largest rank.
    rank = next(m.rank for m in model.modules() if hasattr(m, "lora_A")) if branch.kind != "prod_gate" else \
        next(m.gate.w1.shape[0] for m in model.modules() if hasattr(m, "gate"))
    with torch.device("meta"):
        bigger = LlamaForCausalLM(model.config)
        sparsify(bigger, cfg.method, seed=0, rank=rank + 1)
    assert _branch_parameters(bigger, low_rank_only) > budget

    counts = parameter_counts(model)
    assert counts["branch"] == _branch_parameters(model, low_rank_only=False)
    assert counts["branch_budget_base"] == base
    assert counts["branch_percent"] == pytest.approx(100 * counts["branch"] / base, rel=1e-12)
    if branch.budget_counts == "all":
        assert counts["branch_percent"] <= branch.budget_percent


def test_equal_budgets_give_every_kind_the_same_parameters_up_to_one_rank_step():
    shares = {}
    for kind in ("add", "como", "prod_gate"):
        _, model, base = _budget_case(f"chtsnm_{kind}2_1of4_row")
        shares[kind] = _branch_parameters(model, low_rank_only=False) / base
    # small (d 256, FFN 688, 4 layers; base 19,548,416 at vocab 32000): one rank step is 19,520 parameters (A, B)
    # for add, 19,604 for como (+ the controller's r (h + 1) per projection), 19,548 for prod_gate's gate width:
    # at most 0.1003% of the base, so every share lies in (2% - 0.1003%, 2%].
    step = 19_604 / 19_548_416
    assert all(0.02 - step < s <= 0.02 for s in shares.values()), shares
