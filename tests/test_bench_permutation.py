"""bench/permutation.py --quick writes the four figures issue 8 names, with the memory ratio recomputed from the
measured peaks and the permutation parameter count from the tiny model's widths; its live-tensor counter against
hand-counted bytes; and the performance fixes of distsparse/layers/permutation.py that the benchmark led to (one
gather, or block product, per shared input; the gather kernel) against dense float64 references."""

import json
import math

import pytest
import torch

from bench.memory import LiveTensorBytes
from distsparse.layers.permutation import BlockPermutation
from distsparse.layers.permutation_math import doubly_stochastic, l1_l2_penalty

FIGURES = {"train_step_ratio_soft", "train_step_ratio_hard", "memory_ratio_soft", "infer_ratio_hard"}


@pytest.fixture(scope="module")
def bench():
    from bench import permutation
    return permutation


def test_quick_bench_permutation_writes_every_named_figure(bench, tmp_path, capsys):
    out = tmp_path / "bench_permutation.json"
    threads = torch.get_num_threads()
    try:
        bench.main(["--quick", "warmup=0", "repeats=1", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    payload = json.loads(out.read_text())

    assert set(payload) == FIGURES | {"machine", "config", "wall_ratios", "round_ratio_range", "train_step_ops",
                                      "train_step_ops_ratio_hard", "seconds", "memory_peak_bytes", "load_average"}
    # Hardened, a step adds one gather forward and one backward (each an expand of the index and the gather) per
    # distinct input (qkv, o, gate_up, down) and layer, and nothing else: the shared module's output is reused.
    ops = payload["train_step_ops"]
    assert ops["hard"] - ops["none"] == 2 * 4 * 2 * 2, ops
    assert payload["train_step_ops_ratio_hard"] == ops["hard"] / ops["none"]
    for key in ("train_step_ratio_soft", "train_step_ratio_hard"):
        low, high = payload["round_ratio_range"][key]
        assert low <= payload[key] <= high
    assert set(payload["wall_ratios"]) == FIGURES - {"memory_ratio_soft"}
    assert {"cpu", "cores", "torch", "deepspeed", "transformers", "gpu"} <= set(payload["machine"])
    config = payload["config"]
    assert config["quick"] is True and config["threads"] == 1 and config["micro_batch"] == [2, 64]
    assert all(math.isfinite(payload[k]) and payload[k] > 0 for k in FIGURES)
    # tiny: 2 layers, d 64, FFN 176, block 16; one theta [d / b, b, b] per distinct input (qkv, o, gate_up, down).
    num_theta = 2 * (3 * 64 + 176) * 16
    assert config["permutation_parameters"] == num_theta
    peaks = payload["memory_peak_bytes"]
    assert payload["memory_ratio_soft"] == peaks["soft"] / peaks["none"]
    # The soft model holds at least theta, its gradient and AdamW's two fp32 moments more than the plain one; the
    # plain one at least its fp32 parameters, gradients and moments (vocab 32000 x width 64, embedding and head).
    assert peaks["soft"] - peaks["none"] >= 4 * 4 * num_theta
    assert peaks["none"] >= 4 * 4 * 2 * 32000 * 64
    # head_dim 16 = block size: both readers fold in every layer.
    assert config["fold"]["folded"] == sorted(f"model.layers.{i}.{p}" for i in range(2)
                                              for p in ("mlp.down_proj", "self_attn.o_proj"))
    assert config["penalty"]["lambda"] > 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("infer_ratio_hard")   # table printed last


def test_live_tensor_bytes_counts_each_storage_from_allocation_to_free_and_keeps_the_peak(bench):
    held = torch.zeros(100)                                  # 400 bytes before the mode
    tracker = LiveTensorBytes()
    tracker.hold([held, held[:10]])                          # a view shares the storage: counted once
    with tracker:
        a = torch.ones(1000)                                 # + 4000
        b = (a * 2).view(10, 100)                            # + 4000 (the view adds nothing)
        del a                                                # - 4000
        c = b.double()                                       # + 8000
    assert tracker.peak == 400 + 4000 + 4000 + 8000 - 4000
    del b, c
    assert tracker.current == 400


def permutations_for_test(mode_hard: bool) -> BlockPermutation:
    layer = BlockPermutation(12, 4, seed=5)
    with torch.no_grad():
        layer.theta.copy_(torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(6)))
    if mode_hard:
        layer.harden_all()
    return layer


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
def test_three_readers_of_one_input_share_one_output_and_get_the_summed_gradient(hard):
    layer = permutations_for_test(hard)
    dense = layer.permutation_matrix().double()                   # forward(x) == x @ P^T
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(3, 12, generator=gen, dtype=torch.float64) for _ in range(3)]
    outs = [layer(x) for _ in range(3)]                           # q, k and v read the same normed input
    assert outs[0] is outs[1] is outs[2]
    sum(((o @ w.T) ** 2).sum() for o, w in zip(outs, weights)).backward()

    x_ref = x.detach().clone().requires_grad_(True)
    sum(((x_ref @ dense.T @ w.T) ** 2).sum() for w in weights).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard"])
def test_repeated_forward_backward_on_one_input_builds_a_new_graph_each_time(hard):
    layer = permutations_for_test(hard)
    x = torch.randn(5, 12, requires_grad=True)
    grads = []
    for _ in range(2):                                        # a benchmark loop: same x, backward every time
        x.grad = None
        layer(x).pow(2).sum().backward()
        grads.append(x.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    reference = 2 * (x.detach().double() @ layer.permutation_matrix().double().T) @ layer.permutation_matrix().double()
    torch.testing.assert_close(grads[0].double(), reference, rtol=1e-5, atol=1e-6)


def test_hardening_or_editing_the_input_in_place_recomputes_the_output():
    layer = permutations_for_test(False)
    x = torch.randn(5, 12)
    with torch.no_grad():
        soft = layer(x)
        layer.harden_all()
        hard = layer(x)
        assert hard is not soft and torch.equal(hard, x[:, layer.perm_indices()])
        x.mul_(2)
        assert torch.equal(layer(x), x[:, layer.perm_indices()])


def test_penalty_after_a_forward_reuses_its_blocks_and_gets_the_gradient_of_a_separate_computation(monkeypatch):
    layer = permutations_for_test(False)
    calls = []
    soft_blocks = layer.soft_blocks
    monkeypatch.setattr(layer, "soft_blocks", lambda *a: calls.append(a) or soft_blocks(*a))
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(8))
    (layer(x).pow(2).sum() + 0.3 * layer.penalty()).backward()
    assert len(calls) == 1                                    # one Sinkhorn for the forward and the penalty

    theta = layer.theta.detach().clone().requires_grad_(True)
    blocks = doubly_stochastic(theta, layer.sinkhorn_iters)
    y = torch.einsum("tkj,kij->tki", x.view(5, 3, 4), blocks).reshape(5, 12)
    (y.pow(2).sum() + 0.3 * l1_l2_penalty(blocks).sum()).backward()
    torch.testing.assert_close(layer.theta.grad, theta.grad, rtol=1e-5, atol=1e-7)

    layer.theta.grad = theta.grad = None                      # after a backward the blocks are built again
    layer.penalty().backward()
    l1_l2_penalty(doubly_stochastic(theta, layer.sinkhorn_iters)).sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(layer.theta.grad, theta.grad, rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_recomputes_shared_permutations_to_the_same_gradients():
    from distsparse.config import load_config
    from distsparse.models import build_model
    grads = []
    for checkpointing in ("false", "true"):
        cfg = load_config(None, ["model.preset=tiny", "method.preset=chts24_1of4_row", "method.permutation.mode=learned",
                                 "method.permutation.block_size=16", f"model.activation_checkpointing={checkpointing}"])
        model = build_model(cfg.model, cfg.method, 97, seed=0).train()
        perms = {id(m): m for m in model.modules() if isinstance(m, BlockPermutation)}.values()
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(9))
        loss = model(input_ids=ids, labels=ids).loss + 0.5 * sum(p.penalty() for p in perms)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.endswith("theta") for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
