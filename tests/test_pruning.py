"""One-shot N:M pruning (issue 8 item 4): Wanda and SparseGPT against float64 references written from their
equations, legal 2:4 masks and the error ordering SparseGPT < Wanda < magnitude on a tiny LLaMA trained here,
learned permutations against none on that model with a planted channel structure, and tools/prune_oneshot.py end
to end (export loads, logits match)."""

import copy
import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from distsparse.nm import NMSpec, encode, is_legal
from distsparse.pruning import (
    INPUT_GROUPS, ColumnNormStats, HessianStats, PermutationConfig, PruneConfig, prune_by_scores, prune_model,
    sparsegpt_prune, wanda_scores,
)
from distsparse.pruning.learned_permutation import (
    hungarian, pruned_by_permutation, row_col_penalty, sinkhorn, surrogate_mask, to_original, to_permuted,
)
from rankpool import import_tool

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ, NSAMPLES = 128, 64, 16
PROJECTIONS = [name for _, names in INPUT_GROUPS for name in names]
PAIRS_2_OF_4 = list(itertools.combinations(range(4), 2))


# ----------------------------------------------------------------------------------------------- references

def best_2_of_4_mask(scores: torch.Tensor) -> torch.Tensor:
    """Brute force over the 6 patterns of every group: the pair with the largest summed score (float64)."""
    out_f, in_f = scores.shape
    groups = scores.double().reshape(out_f, in_f // 4, 4)
    sums = torch.stack([groups[..., a] + groups[..., b] for a, b in PAIRS_2_OF_4], -1)
    best = sums.argmax(-1)
    mask = torch.zeros_like(groups, dtype=torch.bool)
    for p, (a, b) in enumerate(PAIRS_2_OF_4):
        mask[..., a] |= best == p
        mask[..., b] |= best == p
    return mask.reshape(out_f, in_f)


def sparsegpt_reference(weight: torch.Tensor, hessian: torch.Tensor, percdamp: float):
    """Column-by-column OBS (SparseGPT s3) with explicit inverses of the trailing Hessian blocks H_F, F = {i..}:
    saliency w_j^2 / [H_{j:}^-1]_00 chooses 2 of each 4 columns on the updated weights; pruning w_i moves the
    rest of the row by -w_i [H_F^-1]_{0,:} / [H_F^-1]_00."""
    W = weight.double().clone()
    H = hessian.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H = H + percdamp * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    cols = W.shape[1]
    keep = torch.zeros_like(W, dtype=torch.bool)
    for i in range(cols):
        if i % 4 == 0:
            d = torch.stack([torch.linalg.inv(H[j:, j:])[0, 0] for j in range(i, i + 4)])
            keep[:, i:i + 4] = best_2_of_4_mask(W[:, i:i + 4] ** 2 / d)
        hf_inv = torch.linalg.inv(H[i:, i:])
        removed = W[:, i] * ~keep[:, i]
        W[:, i:] -= removed[:, None] * hf_inv[0][None, :] / hf_inv[0, 0]
    return W, keep


def linear_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """float64 [tokens, in] input of every projection of `model` on `ids`, by forward hooks."""
    seen: dict[str, torch.Tensor] = {}

    def hook(key):
        return lambda module, args, out: seen.__setitem__(key, args[0].reshape(-1, args[0].shape[-1]).double())

    keys = [f"model.layers.{i}.{name}" for i in range(model.config.num_hidden_layers) for name in PROJECTIONS]
    handles = [model.get_submodule(key).register_forward_hook(hook(key)) for key in keys]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return seen


def reconstruction_errors(dense: torch.nn.Module, pruned: torch.nn.Module, inputs: dict[str, torch.Tensor]):
    """||W X - W_pruned X||_F^2 per projection, on the dense model's calibration inputs X."""
    return {key: float(((dense.get_submodule(key).weight - pruned.get_submodule(key).weight).detach().double()
                        @ x.T).pow(2).sum()) for key, x in inputs.items()}


def cosine_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float((1 - (a64 * b64).sum(-1) / (a64.norm(dim=-1) * b64.norm(dim=-1))).mean())


def markov_stream(num_tokens: int, seed: int) -> np.ndarray:
    """A first-order Markov chain with 4 successors per token (fixed table, skewed probabilities)."""
    succ = np.random.default_rng(123).integers(0, VOCAB, size=(VOCAB, 4))
    choice = np.random.default_rng(seed).choice(4, size=num_tokens, p=[0.55, 0.25, 0.15, 0.05])
    out, token = np.empty(num_tokens, dtype=np.uint16), 0
    for i in range(num_tokens):
        out[i] = token
        token = succ[token, choice[i]]
    return out


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A LlamaForCausalLM (hidden 64, 2 layers, vocab 128) trained 40 steps on a Markov stream, saved with
    save_pretrained, and a packed data dir (train.bin / val.bin uint16 + meta.json)."""
    root = tmp_path_factory.mktemp("pruning")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    stream = torch.from_numpy(markov_stream(20_000, seed=1).astype(np.int64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        starts = torch.randint(0, len(stream) - SEQ, (16,), generator=generator)
        batch = torch.stack([stream[s:s + SEQ] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * np.log(VOCAB), loss.item()   # it learned the chain, weights are not noise
    model.save_pretrained(root / "model")
    data = root / "data"
    data.mkdir()
    markov_stream(20_000, seed=2).tofile(data / "train.bin")
    markov_stream(4_000, seed=3).tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps({"vocab_size": VOCAB, "dtype": "uint16", "mode": "packed"}))
    train = np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64)
    starts = np.random.default_rng(0).integers(0, len(train) - SEQ, NSAMPLES)
    ids = torch.from_numpy(np.stack([train[s:s + SEQ] for s in starts]))
    return {"model_dir": root / "model", "data_dir": data, "ids": ids, "root": root}


@pytest.fixture(scope="module")
def dense(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny["model_dir"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def planted(dense):
    """The trained model with a planted worst case for the identity permutation: every RMSNorm gain is x10 on
    channels 0-3 and 8-11 of each 16 (one permutation block), so the q/k/v and gate/up inputs have two hot
    groups of 4 per block. Unpermuted, 2:4 must drop half of the hot columns; the known best permutation puts
    2 hot and 2 cold channels in every group and drops only cold ones."""
    model = copy.deepcopy(dense)
    hot = (torch.arange(model.config.hidden_size) // 4) % 2 == 0
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.mul_(torch.where(hot, 10.0, 1.0))
    return model


@pytest.fixture(scope="module")
def pruned(tiny, dense):
    """pruned(method, permutation) -> (model, PruneResult), computed once per setting."""
    cache = {}

    def get(method: str, permutation: str = "none"):
        key = method, permutation
        if key not in cache:
            model = copy.deepcopy(dense)
            cfg = PruneConfig(method=method, permutation=permutation, perm=PermutationConfig(block_size=16))
            cache[key] = model, prune_model(model, tiny["ids"], cfg)
        return cache[key]
    return get


# ----------------------------------------------------------------------------------------------- unit tests

def test_wanda_statistic_and_mask_match_a_float64_brute_force():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=gen)
    batches = [torch.randn(3, 5, 16, generator=gen) * torch.linspace(0.1, 3.0, 16) for _ in range(2)]
    stats = ColumnNormStats(16, "cpu")
    for x in batches:
        stats.add(x)
    x64 = torch.cat(batches).double()
    norms = (x64.pow(2).sum((0, 1)) / 6).sqrt()               # ||X_j||_2 / sqrt(num samples)
    torch.testing.assert_close(stats.col_norms().double(), norms, rtol=1e-6, atol=0)

    pruned, mask = prune_by_scores(weight, wanda_scores(weight, stats.col_norms()), 2)
    expected = best_2_of_4_mask(weight.double().abs() * norms[None, :])
    assert torch.equal(mask, expected)
    assert torch.equal(pruned, weight * expected)


def test_sparsegpt_matches_column_by_column_obs_with_explicit_inverses():
    gen = torch.Generator().manual_seed(1)
    mixing = torch.randn(16, 16, generator=gen)
    tokens = torch.randn(4, 50, 16, generator=gen) @ mixing      # correlated input columns
    tokens[..., 5] = 0.0                                        # one dead column
    weight = torch.randn(6, 16, generator=gen, dtype=torch.float64)
    stats = HessianStats(16, "cpu")
    for batch in tokens.split(2):
        stats.add(batch)
    x64 = tokens.double().reshape(-1, 16)
    hessian = 2.0 * x64.T @ x64 / 4
    torch.testing.assert_close(stats.hessian().double(), hessian, rtol=1e-5, atol=1e-3)

    # blocksize 8 < 16 exercises the lazy update of the columns after a block.
    result, keep = sparsegpt_prune(weight, hessian, 2, blocksize=8, percdamp=0.01)
    expected, expected_keep = sparsegpt_reference(weight, hessian, 0.01)
    assert torch.equal(keep, expected_keep)
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-9)
    assert torch.equal(result != 0, keep & (result != 0)) and (result[:, 5] == 0).all()


def test_hungarian_soft_maps_and_penalty_agree_with_brute_force_and_index_gathers():
    gen = torch.Generator().manual_seed(2)
    blocks = torch.rand(3, 4, 4, generator=gen)
    perm = hungarian(blocks)
    for k in range(3):
        best = max(itertools.permutations(range(4)), key=lambda p: sum(float(blocks[k, i, p[i]]) for i in range(4)))
        assert perm[4 * k:4 * k + 4].tolist() == [4 * k + j for j in best]

    hard = F.one_hot(perm.view(3, 4) - torch.arange(3)[:, None] * 4, 4).float()
    a = torch.randn(5, 12, generator=gen)
    assert torch.equal(to_permuted(a, hard), a[:, perm])
    assert torch.equal(to_original(a[:, perm], hard), a)
    assert float(row_col_penalty(hard)) == 0.0
    soft = sinkhorn(blocks, 5)
    assert float(row_col_penalty(soft)) > 0.05
    torch.testing.assert_close(soft.sum(-1), torch.ones(3, 4))


def test_the_straight_through_mask_forward_is_the_hard_mask_in_permuted_coordinates():
    gen = torch.Generator().manual_seed(3)
    weight, scale = torch.randn(6, 16, generator=gen), torch.rand(16, generator=gen) + 0.5
    perm = torch.cat([torch.randperm(8, generator=gen), torch.randperm(8, generator=gen) + 8])
    scores = weight.abs() * scale
    mask_perm = best_2_of_4_mask(scores[:, perm])
    expected = torch.zeros_like(weight)
    for i, j in enumerate(perm.tolist()):                       # column i of permuted space is column j here
        expected[:, j] = weight[:, j] * mask_perm[:, i]
    assert torch.equal(pruned_by_permutation(weight, scale, perm, 2), expected)

    hard = F.one_hot(perm.view(2, 8) - torch.tensor([[0], [8]]), 8).float()
    ste = surrogate_mask(to_permuted(scores, hard), 2, scores.mean(-1, keepdim=True), 0.5)
    torch.testing.assert_close(weight * to_original(ste, hard), expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------- tiny LLaMA

@pytest.mark.parametrize("method, permutation", [("magnitude", "none"), ("wanda", "none"), ("sparsegpt", "none"),
                                                 ("sparsegpt", "random"), ("wanda", "learned")])
def test_every_projection_is_legal_2_4_in_its_permuted_coordinates(pruned, method, permutation):
    model, result = pruned(method, permutation)
    spec = NMSpec(2)
    assert set(result.masks) == {f"model.layers.{i}.{n}" for i in range(2) for n in PROJECTIONS}
    for key, mask in result.masks.items():
        weight = model.get_submodule(key).weight.detach()
        perm = result.perms.get(key, torch.arange(weight.shape[1]))
        assert is_legal(encode(mask, spec)), key
        permuted = weight[:, perm]
        assert not (permuted[~mask] != 0).any(), key            # nothing outside the stored mask survives
        nonzeros = (permuted != 0).reshape(weight.shape[0], -1, 4).sum(-1)
        if method == "sparsegpt":
            assert (nonzeros <= 2).all(), key                   # OBS updates may zero a kept weight
        else:
            assert (nonzeros == 2).all(), key
    if permutation != "none":
        for i in range(2):
            p = lambda n: result.perms[f"model.layers.{i}.{n}"]
            assert torch.equal(p("self_attn.q_proj"), p("self_attn.k_proj"))
            assert torch.equal(p("self_attn.q_proj"), p("self_attn.v_proj"))
            assert torch.equal(p("mlp.gate_proj"), p("mlp.up_proj"))
            for name in PROJECTIONS:                            # block-diagonal with 16-wide blocks
                assert torch.equal(p(name) // 16, torch.arange(p(name).numel()) // 16)
                assert torch.equal(p(name).sort().values, torch.arange(p(name).numel()))


def test_reconstruction_error_orders_sparsegpt_below_wanda_below_magnitude(tiny, dense, pruned):
    inputs = linear_inputs(dense, tiny["ids"])
    errors = {m: reconstruction_errors(dense, pruned(m)[0], inputs) for m in ("magnitude", "wanda", "sparsegpt")}
    total = {m: sum(e.values()) for m, e in errors.items()}
    assert total["sparsegpt"] < total["wanda"] < total["magnitude"], total
    # down_proj reads the most uneven activations (SiLU(gate) * up), so Wanda's column norms matter most there.
    down = {m: sum(v for k, v in e.items() if k.endswith("down_proj")) for m, e in errors.items()}
    assert down["sparsegpt"] < 0.8 * down["wanda"] and down["wanda"] < 0.8 * down["magnitude"], down


def test_learned_permutation_lowers_the_reconstruction_error_against_none(tiny, planted):
    """On the planted model (the identity is the worst grouping), learning must find a better one. Over 3 trained
    models x 3 permutation seeds, at 1 and 2 threads, learned / none measured 0.54-0.65 (layer 0), 0.56-0.67
    (last hidden state) and 0.50-0.67 (stack objective); the planted optimum 0.42-0.46, random ones 0.49-0.74.
    On the unplanted model the channels have no grouping to exploit: learning gained 0-2% there over 3 seeds
    (0 where the guard kept the identity), and which model 40 training steps reach depends on the BLAS kernels,
    so no margin there holds on every machine."""
    caught = {}
    layer0 = planted.model.layers[0]
    handle = layer0.register_forward_hook(
        lambda m, args, kwargs, out: caught.update(args=args, kwargs=kwargs, out=out), with_kwargs=True)
    with torch.no_grad():   # no KV cache: a cache in the caught kwargs would grow with every layer-0 call below
        dense_final = planted.model(input_ids=tiny["ids"], use_cache=False).last_hidden_state
    handle.remove()

    def layer0_gap(model):
        with torch.no_grad():
            return cosine_gap(model.model.layers[0](*caught["args"], **caught["kwargs"]), caught["out"])

    def final_gap(model):
        with torch.no_grad():
            return cosine_gap(model.model(input_ids=tiny["ids"], use_cache=False).last_hidden_state, dense_final)

    def prune(permutation, **perm):
        model = copy.deepcopy(planted)
        cfg = PruneConfig(method="wanda", permutation=permutation, perm=PermutationConfig(block_size=16, **perm))
        return model, prune_model(model, tiny["ids"], cfg)

    (none, _), (learned, _) = prune("none"), prune("learned")
    # Layer 0 sees the same inputs in both runs: its cosine reconstruction is the objective being learned.
    assert layer0_gap(learned) < 0.8 * layer0_gap(none), (layer0_gap(learned), layer0_gap(none))
    assert final_gap(learned) < 0.8 * final_gap(none), (final_gap(learned), final_gap(none))
    # The whole-stack objective is the cosine to the dense model's last hidden state itself (all 8 groups move
    # at once, hence the smaller lr).
    stack, stack_result = prune("learned", objective="stack", lr=0.05)
    assert stack_result.stack["used_learned"]
    assert final_gap(stack) < 0.8 * final_gap(none), (final_gap(stack), final_gap(none))


# ----------------------------------------------------------------------------------------------- the tool

@pytest.fixture(scope="module")
def tool(tiny):
    return import_tool("prune_oneshot")


def test_tool_output_loads_and_its_logits_equal_the_in_memory_pruned_model(tiny, dense, tool, tmp_path):
    out = tmp_path / "out"
    args = ["--model", str(tiny["model_dir"]), "--method", "wanda", "--nm", "2:4", "--permutation", "learned",
            "--perm-block", "16", "--perm-steps", "8", "--calib", str(tiny["data_dir"]), "--nsamples", "8",
            "--seqlen", str(SEQ), "--val-samples", "16", "--out", str(out), "--device", "cpu"]
    report = tool.main(args)

    windows = torch.from_numpy(np.fromfile(tiny["data_dir"] / "val.bin", dtype=np.uint16)[:16 * SEQ]
                               .astype(np.int64)).view(16, SEQ)
    with torch.no_grad():
        dense_loss = float(dense(input_ids=windows, labels=windows).loss)   # equal lengths: token mean
    assert report["ppl_before"] == pytest.approx(np.exp(dense_loss), rel=1e-5)
    assert np.isfinite(report["ppl_after"]) and report["ppl_after"] > report["ppl_before"]

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    in_memory = copy.deepcopy(dense)
    calib = tool.calibration_windows(np.fromfile(tiny["data_dir"] / "train.bin", dtype=np.uint16), 8, SEQ, 0)
    cfg = PruneConfig(method="wanda", permutation="learned", perm=PermutationConfig(block_size=16, steps=8))
    result = prune_model(in_memory, calib, cfg)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=windows).logits, in_memory(input_ids=windows).logits,
                                   rtol=0, atol=1e-6)

    perms = load_file(out / "permutations.safetensors")
    assert set(perms) == set(result.perms)
    for key, perm in perms.items():
        assert torch.equal(perm, result.perms[key])
        permuted = loaded.get_submodule(key).weight.detach()[:, perm]
        assert ((permuted != 0).reshape(permuted.shape[0], -1, 4).sum(-1) == 2).all(), key


@pytest.mark.parametrize("flag, value", [("--nm", "2:8"), ("--nm", "4:4"), ("--nm", "half"), ("--perm-block", "24")])
def test_bad_settings_raise_an_error_naming_the_flag_and_the_value(tiny, tool, tmp_path, flag, value):
    args = ["--model", str(tiny["model_dir"]), "--method", "wanda", "--permutation", "random",
            "--calib", str(tiny["data_dir"]), "--seqlen", str(SEQ), "--out", str(tmp_path / "out"), flag, value]
    with pytest.raises(ValueError) as err:
        tool.main(args)
    assert flag in str(err.value) and value in str(err.value)
    assert not (tmp_path / "out").exists()
