"""The matrix engine beyond two ranks: W = 4 on the 7 matrices of one tiny LLaMA layer, and W = 8 (more ranks
than matrices, so one rank owns nothing). Sharded training, with either gradient accumulation mode, stays identical
on every rank, equals replicated training and equals a single-process reference that applies the update rule to the
mean gradient; the byte count the engine reports equals the bytes its collectives actually send, and the gradient
bytes it holds equal the layout's count (grad_buckets.grad_bytes).

The workers hold a plain module of NMSparseLinear layers with the tiny model's projection shapes (hidden 64,
FFN 176) rather than a LlamaForCausalLM, so they never import transformers. One pool of 8 gloo ranks serves both
sizes: W = 4 runs on a 4-rank subgroup, which also exercises the engine's dedicated-group argument.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distsparse.layers import NMSparseLinear
from distsparse.nm import NMMeta, NMSpec, encode, move_slots, random_mask, slot_map
from distsparse.optim.engine import MatrixEngine
from distsparse.optim.rules import get_rule, init_state
from distsparse.topology import RefreshResult

HIDDEN, FFN = 64, 176
SHAPES = {   # name -> (in, out), the 7 projections of one decoder layer of the tiny model
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
    "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, FFN), "mlp.up_proj": (HIDDEN, FFN), "mlp.down_proj": (FFN, HIDDEN),
}
SPEC = NMSpec.parse("1:4", "row")
STEPS = 8
LR = {"tans": 1e-3, "muon": 0.02}
# TANS's eps is raised from the paper's 1e-5: Gh = G / (sqrt(V) + eps) amplifies the rounding of mean-gradient
# entries that cancel to ~0 across ranks by 1 / eps, and the ring and the one-process reference sum in different
# orders. The distributed code path is the same for any eps.
HPARAMS = {"tans": {"lr": 1e-3, "eps": 1e-2}, "muon": {"lr": 0.02}}


class OneLayer(nn.Module):
    """q -> k -> v -> o, then a SwiGLU MLP; the loss is the sum of squares of its output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.ModuleDict({name.replace(".", "_"): NMSparseLinear(i, o, SPEC, seed=7 + n)
                                   for n, (name, (i, o)) in enumerate(SHAPES.items())})

    def modules_by_name(self) -> dict[str, nn.Module]:
        return {name: self.proj[name.replace(".", "_")] for name in SHAPES}

    def forward(self, x):
        p = self.proj
        h = torch.tanh(p["self_attn_o_proj"](p["self_attn_v_proj"](p["self_attn_k_proj"](p["self_attn_q_proj"](x)))))
        y = p["mlp_down_proj"](F.silu(p["mlp_gate_proj"](h)) * p["mlp_up_proj"](h))
        return y.square().sum()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(1000 * step + rank))


def values_of(model: OneLayer) -> dict[str, torch.Tensor]:
    return {name: m.values.detach().clone() for name, m in model.modules_by_name().items()}


# Sharded accumulation with buckets of a few matrices (the largest, 2816 values, is alone in its bucket).
SMALL_BUCKETS = 4 * 4096


def train(mode: str, rule: str, group=None, grad_accum_mode: str = "auto") -> dict:
    model = OneLayer()
    engine = MatrixEngine(model.modules_by_name(), rule=rule, hparams=get_rule(rule).hparams(**HPARAMS[rule]),
                          mode=mode, group=group, grad_accum_mode=grad_accum_mode, bucket_bytes=SMALL_BUCKETS)
    for step in range(STEPS):
        model(batch(step, engine.rank)).backward()
        assert all(m.values.grad is None for m in model.modules_by_name().values()), "hooks must take the grads"
        engine.reduce_gradients()
        engine.step(LR[rule])
        engine.zero_grad()
    return {"values": values_of(model), "owners": engine.owners, "owned": [m.name for m in engine.owned()],
            "state_bytes": engine.state_bytes(), "accum": engine.grad_accum_mode, "grad_bytes": engine.grad_bytes(),
            "expected_grad_bytes": engine.expected_grad_bytes(), "buckets": len(engine.grad_layout)}


def reference(world_size: int, rule: str) -> dict[str, torch.Tensor]:
    """One process, no engine: the rule applied matrix by matrix to the mean gradient over the ranks' batches."""
    model = OneLayer()
    modules = model.modules_by_name()
    hp = get_rule(rule).hparams(**HPARAMS[rule])
    masters = {n: m.values.detach().clone() for n, m in modules.items()}
    states = {n: init_state(rule, tuple(m.values.shape)) for n, m in modules.items()}
    for step in range(STEPS):
        grads = {n: torch.zeros_like(v) for n, v in masters.items()}
        for r in range(world_size):
            model.zero_grad()
            model(batch(step, r)).backward()
            for n, m in modules.items():
                grads[n] += m.values.grad / world_size
        for n, m in modules.items():
            get_rule(rule).step(masters[n], grads[n], states[n], lr=LR[rule], hp=hp, index=m.index,
                                shape=(m.out_features, m.in_features))
            m.values.data.copy_(masters[n])
    return values_of(model)


def _both_modes(rank, world_size, size, rule):
    # Every rank takes part in creating every group, members or not.
    group = dist.new_group(list(range(size))) if size < world_size else None
    if rank >= size:
        return None
    return (train("sharded", rule, group, "sharded"), train("replicated", rule, group),
            train("sharded", rule, group, "full"))


@pytest.fixture(scope="module")
def ranks8():
    from bench.ranks import RankPool
    pool = RankPool(8)
    yield pool
    pool.close()


def check_training(results, size, rule):
    results = results[:size]
    sharded0 = results[0][0]
    expected = reference(size, rule)
    for r, (sharded, replicated, full) in enumerate(results):
        assert (sharded["accum"], full["accum"], replicated["accum"]) == ("sharded", "full", "full")
        assert sharded["buckets"] > 2, "test setup: several buckets, so reduces overlap and wait on each other"
        assert sharded["owners"] == sharded0["owners"], f"rank {r}: owner map differs from rank 0"
        assert sorted(sharded["owned"]) == sorted(n for n, o in sharded0["owners"].items() if o == r)
        for name, value in sharded["values"].items():
            assert torch.equal(value, sharded0["values"][name]), f"rank {r} {name}: ranks disagree"
            assert torch.equal(full["values"][name], results[0][2]["values"][name]), f"rank {r} {name}: full"
            # Uneven and even reduce-scatters may add the W terms in different orders: equal within rounding.
            for other, label in ((replicated, "replicated"), (full, "full accumulation")):
                torch.testing.assert_close(value, other["values"][name], rtol=0, atol=1e-6,
                                           msg=f"rank {r} {name}: sharded accumulation != {label}")
        for run in (sharded, full):   # the bytes held equal the layout's count (gradients arrive in layout order)
            assert run["grad_bytes"] == run["expected_grad_bytes"], (r, run["accum"])
        assert sharded["grad_bytes"]["persistent"] < full["grad_bytes"]["persistent"] / (size - 1)
    for name, value in sharded0["values"].items():
        torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=1e-6,
                                   msg=f"{name}: engine != reference")
        assert not torch.equal(value, OneLayer().modules_by_name()[name].values.detach()), f"{name} did not train"
    return [sharded for sharded, _, _ in results]


def test_four_ranks_share_the_seven_matrices_and_train_like_one_process(ranks8):
    sharded = check_training(ranks8.run(_both_modes, 4, "tans"), 4, "tans")
    assert set(sharded[0]["owners"].values()) == {0, 1, 2, 3}, "every rank owns a matrix at W = 4"
    assert sum(len(s["owned"]) for s in sharded) == 7


def test_eight_ranks_leave_one_idle_owner_and_still_agree(ranks8):
    sharded = check_training(ranks8.run(_both_modes, 8, "muon"), 8, "muon")
    idle = [r for r, s in enumerate(sharded) if not s["owned"]]
    assert len(idle) == 1 and len(set(sharded[0]["owners"].values())) == 7
    busy = min(s["state_bytes"] for r, s in enumerate(sharded) if r not in idle)
    assert sharded[idle[0]]["state_bytes"] < busy, "an idle rank holds no master or rule state"


# ---- bytes on the wire -------------------------------------------------------------------------------------------

def _count_sent_bytes(world_size: int, log: list):
    """Wrap the collectives the engine calls; record what a ring algorithm makes this rank send."""
    originals = {n: getattr(dist, n) for n in ("reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor",
                                               "all_reduce")}

    def reduce_scatter_tensor(output, input, *a, **k):
        log.append(("reduce", (world_size - 1) * output.numel() * output.element_size()))
        return originals["reduce_scatter_tensor"](output, input, *a, **k)

    def reduce_scatter(output, inputs, *a, **k):   # uneven segments: a ring sends every segment but its own
        sent = sum(t.numel() * t.element_size() for t in inputs) - output.numel() * output.element_size()
        log.append(("reduce", sent))
        return originals["reduce_scatter"](output, inputs, *a, **k)

    def all_gather_into_tensor(output, input, *a, **k):
        kind = "codes" if input.dtype == torch.uint8 else "values"
        log.append((kind, (world_size - 1) * input.numel() * input.element_size()))
        return originals["all_gather_into_tensor"](output, input, *a, **k)

    def all_reduce(tensor, *a, **k):
        kind = "reduce" if tensor.numel() > 1 else "scalars"
        log.append((kind, 2 * (world_size - 1) / world_size * tensor.numel() * tensor.element_size()))
        return originals["all_reduce"](tensor, *a, **k)

    for name, fn in (("reduce_scatter_tensor", reduce_scatter_tensor), ("reduce_scatter", reduce_scatter),
                     ("all_gather_into_tensor", all_gather_into_tensor), ("all_reduce", all_reduce)):
        setattr(dist, name, fn)
    return originals


def _new_pattern(name: str, master: torch.Tensor, meta: NMMeta) -> RefreshResult:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    new = encode(random_mask(*meta.shape, meta.spec, gen), meta.spec)
    slots = slot_map(meta, new)
    return RefreshResult(new, slots, move_slots(master, slots), {})


def _measured_bytes(rank, world_size, size, mode, reduce_dtype, dtype, accum, micro_batches):
    group = dist.new_group(list(range(size))) if size < world_size else None
    if rank >= size:
        return None
    model = OneLayer().to(dtype)
    engine = MatrixEngine(model.modules_by_name(), rule="tans", hparams=get_rule("tans").hparams(), mode=mode,
                          reduce_dtype=reduce_dtype, group=group, grad_accum_mode=accum, micro_batches=micro_batches,
                          bucket_bytes=SMALL_BUCKETS)
    per_step = []
    for refresh in (None, _new_pattern):
        log = []
        originals = _count_sent_bytes(size, log)
        try:   # the engine's part of a step: backward (sharded accumulation reduces there), reduce, update and
            for micro in range(micro_batches):   # gather (the step's scalars are the joint step's)
                engine.start_boundary() if micro == micro_batches - 1 else engine.start_micro_step()
                model(batch(micro, rank).to(dtype)).backward()
            engine.reduce_gradients()
            engine.step(1e-3, refresh=refresh)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        engine.zero_grad()
        sent = {}
        for kind, nbytes in log:
            sent[kind] = sent.get(kind, 0.0) + nbytes
        per_step.append(sent)
    codes = {n: m.codes.clone() for n, m in model.modules_by_name().items()}
    return per_step, engine.comm_bytes_per_step(None), engine.comm_bytes_per_step(1), codes


@pytest.mark.parametrize("mode,reduce_dtype,dtype,accum,micro_batches", [
    ("sharded", "fp32", torch.bfloat16, "full", 1), ("sharded", "bf16", torch.bfloat16, "sharded", 2),
    ("replicated", "bf16", torch.float32, "full", 1)])
def test_reported_bytes_per_step_equal_the_bytes_the_collectives_send(ranks8, mode, reduce_dtype, dtype, accum,
                                                                      micro_batches):
    results = ranks8.run(_measured_bytes, 4, mode, reduce_dtype, dtype, accum, micro_batches)[:4]
    for r, ((plain, refreshed), no_refresh, every_step, codes) in enumerate(results):
        for kind in ("reduce", "values", "codes"):
            assert no_refresh[kind] == pytest.approx(plain.get(kind, 0.0), rel=1e-12), (r, kind)
            assert every_step[kind] == pytest.approx(refreshed.get(kind, 0.0), rel=1e-12), (r, kind)
        assert no_refresh["total"] == pytest.approx(sum(plain.values()), rel=1e-12)
        for name, c in codes.items():
            assert torch.equal(c, results[0][3][name]), f"rank {r} {name}: codes differ after the refresh"
    if mode == "sharded":
        assert results[0][2]["codes"] > 0 and results[0][1]["values"] > 0
    if accum == "full" and mode == "sharded":
        assert results[0][1]["reduce"] == 2 * results[0][1]["values"], "fp32 gradients out, bf16 values back"
    if accum == "sharded":
        # Per micro-batch every value crosses the wire once from each rank but its owner, in bf16; segments are
        # padded to 128 values (at most one padded segment per rank and matrix).
        values = sum(o * i // 4 for i, o in SHAPES.values())
        sent = sum(r[1]["reduce"] for r in results)
        assert micro_batches * 3 * values * 2 <= sent <= micro_batches * 3 * (values + 4 * 7 * 127) * 2


def test_refresh_interval_must_be_a_positive_integer():
    engine = MatrixEngine(OneLayer().modules_by_name(), rule="adam", hparams=get_rule("adam").hparams())
    with pytest.raises(ValueError, match="refresh_interval: got 0"):
        engine.comm_bytes_per_step(0)
    assert engine.comm_bytes_per_step(100)["total"] == 0.0, "one process sends nothing"
