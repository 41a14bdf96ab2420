"""Folding hardened permutations into the previous layer's output rows (distsparse/layers/fold.py, issue 8 item 3)
and the HF export that applies it (tools/export_hf.py): logits before folding are the reference; weights are checked
against W[perm, :] of the unfolded model, exported weights against the N:M rule and the decompressed values."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from distsparse.config import load_config
from distsparse.layers import NMSparseLinear
from distsparse.layers.fold import fold_permutations, value_permutation
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.projection import SparseProjection, backbone_core
from distsparse.models import build_model, llama_config, projection_names
from rankpool import import_tool

VOCAB, LAYERS = 97, 2


def config(preset: str, *extra: str):
    return load_config(None, ["model.preset=tiny", f"method.preset={preset}", "method.permutation.mode=learned",
                              "method.permutation.block_size=16", *extra])


def build(preset: str, *extra: str):
    cfg = config(preset, *extra)
    model = build_model(cfg.model, cfg.method, VOCAB, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("theta"):
                p.copy_(torch.rand(p.shape, generator=gen))        # a random Hungarian optimum per block
            elif name.rsplit(".", 1)[-1] in ("lora_B", "w2", "b2"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))  # zero at init: branches would add nothing
    return model.eval()


def harden_everything(model, skip: str | None = None) -> dict[str, torch.Tensor]:
    """Harden every permutation but the one of projection `skip`; returns {first projection using it: perm}
    (named_modules lists a shared permutation once, under q_proj or gate_proj)."""
    perms = {}
    for name, module in model.named_modules():
        projection = name.rsplit(".", 1)[0]
        if isinstance(module, BlockPermutation) and projection != skip:
            module.harden_all()
            perms[projection] = module.perm_indices()
    return perms


def logits(model) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(ids).logits


def dense(module) -> torch.Tensor:
    core = backbone_core(module)
    return core.dense_weight() if isinstance(core, NMSparseLinear) else core.weight.detach().clone()


def has_gather(module) -> bool:
    return any(isinstance(m, BlockPermutation) for m in module.modules())


def shared_input_projections() -> set[str]:
    return {f"model.layers.{i}.{p}" for i in range(LAYERS)
            for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}


def test_row_wise_model_folds_down_and_o_gathers_into_the_writers_rows_with_equal_logits():
    model = build("chts24_1of4_row")
    perms = harden_everything(model)
    before = logits(model)
    weights = {name: dense(model.get_submodule(name)) for name in shared_input_projections()}
    report = fold_permutations(model)

    assert (logits(model) - before).abs().max().item() < 1e-5
    for i in range(LAYERS):
        mlp, attn = f"model.layers.{i}.mlp", f"model.layers.{i}.self_attn"
        down_perm, o_perm = perms[f"{mlp}.down_proj"], perms[f"{attn}.o_proj"]
        assert not torch.equal(down_perm, torch.arange(down_perm.numel()))     # folding had something to do
        assert not torch.equal(o_perm, torch.arange(o_perm.numel()))
        assert report["folded"][f"{mlp}.down_proj"] == [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
        assert report["folded"][f"{attn}.o_proj"] == [f"{attn}.v_proj"]
        assert isinstance(model.get_submodule(f"{mlp}.down_proj"), NMSparseLinear)   # bare core: no gather left
        assert isinstance(model.get_submodule(f"{attn}.o_proj"), NMSparseLinear)
        for writer in ("gate_proj", "up_proj"):
            assert torch.equal(dense(model.get_submodule(f"{mlp}.{writer}")), weights[f"{mlp}.{writer}"][down_perm])
        # n_heads = n_kv_heads here, so v's rows take o's permutation itself.
        assert torch.equal(dense(model.get_submodule(f"{attn}.v_proj")), weights[f"{attn}.v_proj"][o_perm])
    assert set(report["kept"]) == shared_input_projections()
    assert all("residual stream" in why for why in report["kept"].values())
    for name in shared_input_projections():
        assert has_gather(model.get_submodule(name))


def test_block_wise_model_keeps_every_gather_and_its_logits():
    model = build("chts24_1of4_block")
    harden_everything(model)
    before = logits(model)
    report = fold_permutations(model)

    assert report["folded"] == {}
    readers = {f"model.layers.{i}.{p}" for i in range(LAYERS) for p in ("mlp.down_proj", "self_attn.o_proj")}
    assert set(report["kept"]) == readers | shared_input_projections()
    for name in readers:
        assert "block-wise" in report["kept"][name] and has_gather(model.get_submodule(name))
    assert torch.equal(logits(model), before)


@pytest.mark.parametrize("preset", ["chts24_como_1of4_row", "chtsnm_prod_gate1_1of4_row", "chtsnm_add1_1of4_row"])
def test_models_with_branches_fold_both_sides_of_the_branches_exactly(preset):
    model = build(preset)
    harden_everything(model)
    before = logits(model)
    report = fold_permutations(model)

    assert len(report["folded"]) == 2 * LAYERS
    assert (logits(model) - before).abs().max().item() < 1e-5
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(down, SparseProjection) and down.branch is not None and down.permutation is None


def test_o_proj_keeps_its_gather_when_permutation_blocks_span_two_heads():
    model = build("chts24_1of4_row", "model.num_attention_heads=8")   # head_dim 8 < block size 16
    perms = harden_everything(model)
    before = logits(model)
    o_perm = perms["model.layers.0.self_attn.o_proj"]
    assert bool((o_perm // 8 != torch.arange(o_perm.numel()) // 8).any())   # some feature changes head
    report = fold_permutations(model)

    assert "between attention heads" in report["kept"]["model.layers.0.self_attn.o_proj"]
    assert has_gather(model.get_submodule("model.layers.0.self_attn.o_proj"))
    assert "model.layers.0.mlp.down_proj" in report["folded"]
    assert (logits(model) - before).abs().max().item() < 1e-5


def test_soft_permutations_are_kept_with_the_count_of_soft_blocks():
    model = build("chts24_1of4_row")
    harden_everything(model, skip="model.layers.1.mlp.down_proj")
    down = model.get_submodule("model.layers.1.mlp.down_proj").permutation
    down.harden(torch.arange(down.num_blocks) >= 3)      # blocks 0, 1, 2 stay soft
    before = logits(model)
    report = fold_permutations(model)

    assert report["kept"]["model.layers.1.mlp.down_proj"].startswith(f"3 of {down.num_blocks} permutation blocks")
    assert "model.layers.0.mlp.down_proj" in report["folded"]
    assert (logits(model) - before).abs().max().item() < 1e-5


def attention64(q, k, v, num_heads, num_kv_heads, head_dim):
    """float64 softmax(q k^T / sqrt(hd)) v per head, heads concatenated [T, H * hd]; q head h reads kv head
    h // (H / KV)."""
    outs = []
    for h in range(num_heads):
        j = h // (num_heads // num_kv_heads)
        qh, kh, vh = (t[:, s * head_dim:(s + 1) * head_dim] for t, s in ((q, h), (k, j), (v, j)))
        outs.append(torch.softmax(qh @ kh.T / math.sqrt(head_dim), dim=-1) @ vh)
    return torch.cat(outs, dim=1)


def test_value_permutation_makes_grouped_query_attention_emit_the_permuted_output():
    num_heads, num_kv, hd = 4, 2, 3
    local = [[2, 0, 1], [2, 0, 1], [1, 2, 0], [1, 2, 0]]               # heads 0, 1 share kv head 0; 2, 3 kv head 1
    perm = torch.tensor([h * hd + j for h in range(num_heads) for j in local[h]])
    rows, reason = value_permutation(perm, num_heads, num_kv, hd)
    assert reason == "" and rows.tolist() == [2, 0, 1, 4, 5, 3]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, num_heads * hd, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(5, num_kv * hd, generator=gen, dtype=torch.float64) for _ in range(2))
    reference = attention64(q, k, v, num_heads, num_kv, hd)[:, perm]
    assert torch.allclose(attention64(q, k, v[:, rows], num_heads, num_kv, hd), reference, atol=1e-12)


def test_value_permutation_refuses_grouped_heads_with_different_permutations():
    local = [[2, 0, 1], [0, 1, 2], [1, 2, 0], [1, 2, 0]]
    perm = torch.tensor([h * 3 + j for h in range(4) for j in local[h]])
    rows, reason = value_permutation(perm, 4, 2, 3)
    assert rows is None and "sharing one key/value head" in reason


@pytest.mark.parametrize("preset", ["ste_1of4_row", "cast_1of4_row"])
def test_dense_latent_baselines_fold_with_their_masks_and_scales(preset):
    model = build(preset)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".scale"):      # CAST scales start at 1: make the row permutation of s matter
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(4)) + 0.5)
    # Eval mode: ste masks |W| per row group, CAST projects W * s the same way (the export weight).
    harden_everything(model)
    before = logits(model)
    report = fold_permutations(model)

    assert len(report["folded"]) == 2 * LAYERS
    assert (logits(model) - before).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def export_hf():
    return importlib.import_module("distsparse.cli.export_hf")


def save_and_reload(export_hf, model, path):
    from transformers import AutoModelForCausalLM
    export_hf.save_hf_model(model, llama_config(config("chts24_1of4_row").model, VOCAB), path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    return reloaded.eval()


def one_of_four_per_group(weight: torch.Tensor) -> bool:
    """Row-wise 1:4: at most one nonzero in every group of 4 consecutive columns of a row."""
    return bool(((weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1) <= 1).all())


def test_export_of_a_model_whose_permutations_all_fold_reloads_with_equal_logits_and_n_m_weights(export_hf, tmp_path):
    model = build("chts24_1of4_row")
    for layer in model.model.layers:      # keep only the foldable permutations (o_proj, down_proj)
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            for name in names:
                setattr(parent, name, getattr(parent, name).core)
    harden_everything(model)
    before = logits(model)
    report = export_hf.fold_for_export(model, require_nm=True)
    assert len(report["folded"]) == 2 * LAYERS and report["kept"] == {}
    reloaded = save_and_reload(export_hf, model, tmp_path / "hf")

    assert (logits(reloaded) - before).abs().max().item() < 1e-5
    for name in projection_names(reloaded):
        assert one_of_four_per_group(reloaded.get_submodule(name).weight), name


def test_export_keeps_shared_input_gathers_in_their_own_columns_unless_n_m_weights_are_required(export_hf, tmp_path):
    model = build("chts24_1of4_row")
    perms = harden_everything(model)
    before = logits(model)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj: .*residual stream.*--require-nm"):
        export_hf.fold_for_export(model, require_nm=True)
    assert has_gather(model.get_submodule("model.layers.0.mlp.down_proj"))     # the refusal changed nothing
    report = export_hf.fold_for_export(model)
    assert set(report["kept"]) == shared_input_projections()
    reloaded = save_and_reload(export_hf, model, tmp_path / "hf")

    assert (logits(reloaded) - before).abs().max().item() < 1e-5
    for i in range(LAYERS):
        for group, names in (("self_attn.q_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            perm = perms[f"model.layers.{i}.{group}"]
            for name in names:
                name = f"model.layers.{i}.{name}"
                hf_weight = reloaded.get_submodule(name).weight.detach()
                # W_hf = W[:, inv]: the trained N:M matrix is W_hf[:, perm], not W_hf itself
                assert torch.equal(hf_weight[:, perm], dense(model.get_submodule(name))), name
                assert not one_of_four_per_group(hf_weight), name
        for name in ("mlp.down_proj", "self_attn.o_proj"):
            assert one_of_four_per_group(reloaded.get_submodule(f"model.layers.{i}.{name}").weight)


def test_export_refuses_a_soft_permutation_naming_the_projection(export_hf):
    cfg = config("chts24_1of4_row")
    model = build("chts24_1of4_row")
    harden_everything(model, skip="model.layers.1.mlp.down_proj")
    down = model.get_submodule("model.layers.1.mlp.down_proj").permutation
    with pytest.raises(ValueError, match=rf"model.layers.1.mlp.down_proj: {down.num_blocks} of {down.num_blocks} "
                                         r"input permutation blocks are still soft.*T_perm"):
        export_hf.check_exportable(SimpleNamespace(cfg=cfg, model=model))
