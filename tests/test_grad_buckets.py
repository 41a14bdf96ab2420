"""Gradient buckets (distsparse/optim/grad_buckets.py): the layout both accumulation modes and bench/scale_check.py
share, the rule behind engine.grad_accum_mode=auto, its config errors, and the trainer in both modes (exact resume,
gradient accumulation k x 1 == 1 x k)."""

import random

import pytest
import torch

from distsparse.config import load_config
from distsparse.models import backbone_param
from distsparse.optim.grad_buckets import ALIGN, backward_order, bucket_layout, resolve_grad_accum_mode
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir


def _random_model(seed: int, world_size: int):
    rng = random.Random(seed)
    numel = {f"m{i:02d}": rng.choice([1, 100, 128, 129, 1000, 5000, 20000]) for i in range(40)}
    owners = {name: rng.randrange(world_size) for name in numel}
    return numel, owners


def _check_segments(bucket, numel, owners, world_size):
    """Each rank's matrices lie back to back from 0 in its segment, in bucket order; the segment is their sum,
    rounded up to ALIGN."""
    for r in range(world_size):
        mine = [n for n in bucket.names if owners[n] == r]
        starts = [sum(numel[m] for m in mine[:k]) for k in range(len(mine))]
        assert [bucket.offsets[n] for n in mine] == starts
        total = sum(numel[n] for n in mine)
        assert bucket.segments[r] % ALIGN == 0 and total <= bucket.segments[r] < total + ALIGN


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_sharded_layout_is_greedy_under_the_byte_cap_in_backward_order(world_size):
    numel, owners = _random_model(world_size, world_size)
    cap = 4 * 30000
    layout = bucket_layout(numel, owners, world_size, bucket_bytes=cap)
    assert [n for b in layout for n in b.names] == backward_order(numel), "every matrix once, in backward order"
    for i, bucket in enumerate(layout):
        _check_segments(bucket, numel, owners, world_size)
        assert 4 * bucket.numel <= cap or len(bucket.names) == 1, "over the cap only a matrix alone"
        if i + 1 < len(layout):   # greedy: the next matrix would not have fit
            nxt = layout[i + 1].names[0]
            fill = [sum(numel[n] for n in bucket.names if owners[n] == r) for r in range(world_size)]
            fill[owners[nxt]] += numel[nxt]
            assert 4 * sum(-(-f // ALIGN) * ALIGN for f in fill) > cap, i
    assert len(layout) > 3


def test_full_layout_splits_by_count_and_pads_every_shard_to_the_largest_segment():
    numel, owners = _random_model(0, 4)
    layout = bucket_layout(numel, owners, 4, num_buckets=3)
    assert [len(b.names) for b in layout] == [14, 14, 12]
    assert [n for b in layout for n in b.names] == backward_order(numel)
    for bucket in layout:
        _check_segments(bucket, numel, owners, 4)
        assert bucket.shard_size == max(bucket.segments)


def test_backward_order_is_deepest_layer_first_then_llamas_projections_in_reverse_forward_order():
    """The order hooks fire in a real LLaMA backward, recorded, against the order derived from the names."""
    from distsparse.models import backbone_modules, backbone_param, build_model

    cfg = load_config(None, ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row",
                             "model.num_hidden_layers=12"])
    model = build_model(cfg.model, cfg.method, 97, seed=0)
    backbone = backbone_modules(model)
    fired = []
    for name, module in backbone.items():
        backbone_param(module).register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randint(0, 97, (1, 8))
    model(input_ids=x, labels=x).loss.backward()
    assert list(backbone) != fired, "test setup: the modules come in name order, not in backward order"
    assert backward_order(reversed(list(backbone))) == backward_order(backbone) == fired
    assert backward_order(["b.2.x", "b.10.x", "k_proj", "b.2.up_proj", "b.2.q_proj", "a"]) == [
        "b.10.x", "b.2.up_proj", "b.2.q_proj", "b.2.x", "k_proj", "a"]


def test_layout_arguments_are_checked():
    numel, owners = _random_model(0, 2)
    with pytest.raises(ValueError, match="exactly one of num_buckets"):
        bucket_layout(numel, owners, 2)
    with pytest.raises(ValueError, match="exactly one of num_buckets"):
        bucket_layout(numel, owners, 2, num_buckets=2, bucket_bytes=10)
    with pytest.raises(ValueError, match="engine.num_buckets: got 0"):
        bucket_layout(numel, owners, 2, num_buckets=0)
    with pytest.raises(ValueError, match="engine.bucket_bytes: got 0"):
        bucket_layout(numel, owners, 2, bucket_bytes=0)


@pytest.mark.parametrize("world_size,micro_batches,expected", [
    (1, 1, "full"), (1, 4, "full"),            # nothing to shard
    (2, 1, "sharded"), (8, 1, "sharded"),      # one micro-batch: the same reduces, 1/W of the bytes
    (2, 4, "full"),                            # k x the reduce traffic to save half the buffer: no
    (3, 4, "sharded"), (64, 8, "sharded")])    # k x the traffic to save at least 2/3 .. 63/64: yes
def test_auto_picks_sharded_where_it_saves_memory_for_its_traffic(world_size, micro_batches, expected):
    assert resolve_grad_accum_mode("auto", replicated=False, world_size=world_size,
                                   micro_batches=micro_batches) == expected
    for mode in ("full", "sharded"):
        assert resolve_grad_accum_mode(mode, replicated=False, world_size=world_size,
                                       micro_batches=micro_batches) == mode
    assert resolve_grad_accum_mode("auto", replicated=True, world_size=world_size,
                                   micro_batches=micro_batches) == "full"


def test_bad_accumulation_settings_name_the_key_before_any_process_starts():
    with pytest.raises(ValueError, match=r"engine.grad_accum_mode: got 'zero2'; allowed: auto, full, sharded"):
        load_config(None, ["engine.grad_accum_mode=zero2"])
    with pytest.raises(ValueError, match=r"engine.grad_accum_mode: got 'sharded' with engine.mode 'replicated'"):
        load_config(None, ["engine.mode=replicated", "engine.grad_accum_mode=sharded"])
    with pytest.raises(ValueError, match=r"engine.bucket_bytes: got 0"):
        load_config(None, ["engine.bucket_bytes=0"])
    with pytest.raises(ValueError, match=r"engine.grad_accum_mode: got 'sharded' with engine.mode 'replicated'"):
        resolve_grad_accum_mode("sharded", replicated=True, world_size=2, micro_batches=1)


# ---- the trainer in both modes -----------------------------------------------------------------------------------

BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1000", "train.warmup_steps=0", "train.eval_samples=16", "train.grad_clip=0.5",
        "method.preset=chtsnm_nobranch_1of4_row", "method.topology.update_interval=2", "train.steps=4"]


def _train(rank, world_size, data_dir, out_dir, overrides):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    trainer.train()
    out = {"values": {n: backbone_param(m).detach().clone() for n, m in trainer.backbone.items()},
           "codes": {n: m.codes.clone() for n, m in trainer.backbone.items()},
           "dense": {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "embed" in n},
           "mode": trainer.matrix.grad_accum_mode, "grad_bytes": trainer.matrix.grad_bytes(),
           "buckets": len(trainer.matrix.grad_layout)}
    trainer.close()
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("mode", ["full", "sharded"])
def test_the_trainer_resumes_bit_for_bit_in_both_accumulation_modes(ranks2, data_dir, tmp_path, mode):
    args = ["train.micro_batch=1", "train.grad_accum=2", f"engine.grad_accum_mode={mode}", "engine.bucket_bytes=8000"]
    whole = ranks2.run(_train, data_dir, str(tmp_path / "whole"), args + ["checkpoint.interval=2"])
    step2 = tmp_path / "whole" / "checkpoints" / "step00000002"
    resumed = ranks2.run(_train, data_dir, str(tmp_path / "resumed"), args + [f"checkpoint.resume={step2}"])
    assert whole[0]["mode"] == resumed[0]["mode"] == mode
    assert whole[0]["buckets"] == (4 if mode == "full" else 14), "engine.num_buckets / engine.bucket_bytes"
    for part in ("values", "codes", "dense"):
        for name, value in whole[0][part].items():
            assert torch.equal(value, resumed[0][part][name]), (part, name)


def test_gradient_accumulation_1x4_equals_4x1_with_sharded_accumulation(ranks2, data_dir, tmp_path):
    a = ranks2.run(_train, data_dir, str(tmp_path / "a"), ["train.micro_batch=4", "train.grad_accum=1"])
    b = ranks2.run(_train, data_dir, str(tmp_path / "b"), ["train.micro_batch=1", "train.grad_accum=4",
                                                           "engine.grad_accum_mode=sharded"])
    c = ranks2.run(_train, data_dir, str(tmp_path / "c"), ["train.micro_batch=1", "train.grad_accum=4"])
    assert (a[0]["mode"], b[0]["mode"], c[0]["mode"]) == ("sharded", "sharded", "full"), "auto at W = 2"
    for other in (b, c):
        for part in ("values", "dense"):
            for name, value in a[0][part].items():
                torch.testing.assert_close(value, other[0][part][name], rtol=1e-4, atol=1e-5, msg=name)
    # The rank's own gradients only, against the W x shard buffer of every gradient.
    assert 2 * b[0]["grad_bytes"]["persistent"] <= c[0]["grad_bytes"]["persistent"] + 4 * ALIGN * 14


# ---- overlap: the reduces start from the hooks, one per bucket, while backward still runs --------------------------

def _reduces_among_gradients(rank, world_size, accum):
    """Two micro-batches of a 2-layer tiny LLaMA under `accum`: the log of backbone gradients as they arrive (hooks
    registered before the engine's, so each name is logged before the engine takes the gradient) and of every
    reduce the engine launches, with the end of each backward and of reduce_gradients marked."""
    import torch.distributed as dist

    from distsparse.models import backbone_modules, build_model
    from distsparse.optim.engine import MatrixEngine
    from distsparse.optim.rules import get_rule

    cfg = load_config(None, ["model.preset=tiny", "method.preset=chtsnm_nobranch_1of4_row",
                             "model.num_hidden_layers=2"])
    model = build_model(cfg.model, cfg.method, 97, seed=0)
    backbone = backbone_modules(model)
    log: list[str] = []
    for name, module in backbone.items():
        backbone_param(module).register_post_accumulate_grad_hook(lambda p, name=name: log.append(name))
    engine = MatrixEngine(backbone, rule="tans", hparams=get_rule("tans").hparams(), grad_accum_mode=accum,
                          micro_batches=2, num_buckets=3, bucket_bytes=4 * 6000)
    originals = {n: getattr(dist, n) for n in ("reduce_scatter", "reduce_scatter_tensor", "all_reduce")}

    def logged(n):
        def call(*args, **kwargs):
            log.append("REDUCE")
            return originals[n](*args, **kwargs)
        return call
    try:
        for n in originals:
            setattr(dist, n, logged(n))
        x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(rank))
        for micro, part in enumerate(x.chunk(2)):
            engine.start_boundary() if micro == 1 else engine.start_micro_step()
            model(input_ids=part, labels=part).loss.backward()
            log.append("END BACKWARD")
        engine.reduce_gradients()
        log.append("END REDUCE")
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return log, [list(b.names) for b in engine.grad_layout]


@pytest.mark.parametrize("accum", ["full", "sharded"])
def test_each_bucket_reduces_from_the_hooks_as_soon_as_its_last_gradient_arrives(ranks2, accum):
    """Sharded: in every backward, each bucket's reduce-scatter is launched right after its last gradient, before the
    next bucket's first (overlap with the rest of the backward). Full: the same in the last backward only, none in
    the others. reduce_gradients() then only waits."""
    for log, layout in ranks2.run(_reduces_among_gradients, accum):
        assert len(layout) > 2, "test setup: several buckets"
        overlapped = [name for bucket in layout for name in bucket + ["REDUCE"]]
        names_only = [name for bucket in layout for name in bucket]
        first = overlapped if accum == "sharded" else names_only
        assert log == first + ["END BACKWARD"] + overlapped + ["END BACKWARD", "END REDUCE"], accum
