"""The joint step through the real Trainer on 2 gloo ranks (DESIGN decision 18): one clip coefficient for both sides,
DeepSpeed's threshold left at train.grad_clip after every step and in every checkpoint, both sides skipping together
on a non-finite gradient of either, and the step's scalars in one all-reduce.

Applied coefficients are read back from the updates. Both sides run Adam with beta1 = beta2 = 0, eps = 1, lr = 1 and no
weight decay: every step then moves a weight by d = -c g / (c |g| + 1), c the clip coefficient and g the mean gradient
over both ranks' batches, with no history, so c = -d / (g + d |g|) can be solved on any step. g comes from a float64
reference computed in one process on a copy of the current weights.
"""

import math
from pathlib import Path

import pytest
import torch

from adam_readback import applied_coefficient
from distsparse.config import load_config
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97
BASE = ["model.preset=tiny", "model.num_hidden_layers=1", "data.seq_len=16", "train.micro_batch=2",
        "method.preset=chts24_1of4_row", "train.steps=6", "train.warmup_steps=0", "train.eval_interval=1000",
        "train.log_interval=1000", "train.weight_decay=0.0"]
HISTORY_FREE = ["train.lr=1.0", "method.lr=1.0", "train.min_lr_ratio=1.0", "train.beta1=0.0", "train.beta2=0.0",
                "method.rule_args={beta1: 0.0, beta2: 0.0, eps: 1.0}", "train.dtype=fp32"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def _batch(rank: int) -> dict[str, torch.Tensor]:
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(50 + rank))
    return {"input_ids": x, "labels": x}


def _trainer(data_dir, out_dir, overrides, eps=None, bf16_overflow_check=None):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}"] + overrides)
    ds_config = build_ds_config(ROOT / "configs/ds/zero2.json", cfg)
    if eps is not None:
        ds_config["optimizer"]["params"]["eps"] = eps
    if bf16_overflow_check is not None:
        ds_config["bf16"]["check_grad_overflow"] = bf16_overflow_check
    return cfg, Trainer(cfg, ds_config)


def _backbone_names(trainer) -> set[str]:
    from distsparse.models import backbone_param
    ids = {id(backbone_param(m)) for m in trainer.backbone.values()}
    return {n for n, p in trainer.model.named_parameters() if id(p) in ids}


def _reference_gradients(cfg, trainer, world_size) -> dict[str, torch.Tensor]:
    """float64 mean over both ranks' batches of every parameter's gradient of the loss, at the trainer's current
    weights, on a fresh copy of the model in this process."""
    from distsparse.models import build_model
    model = build_model(cfg.model, cfg.method, VOCAB, cfg.train.seed)
    model.load_state_dict(trainer.model.state_dict())
    grads = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    for r in range(world_size):
        model.zero_grad()
        model(**_batch(r)).loss.backward()
        for n, p in model.named_parameters():
            grads[n] += p.grad.double() / world_size
    return grads


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _saved_clip(path: Path, rank: int) -> float:
    """DeepSpeed's clip threshold as its checkpoint file of this rank holds it (DeepSpeed's own pickle)."""
    sd = torch.load(path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    return float(sd["optimizer_state_dict"]["clip_grad"])


def _clip_then_no_clip(rank, world_size, data_dir, out_dir):
    from distsparse.models import backbone_param
    cfg, trainer = _trainer(data_dir, out_dir, HISTORY_FREE + ["train.grad_clip=1.0"], eps=1.0)
    scale = [1.0]
    forward = trainer.engine.forward

    def scaled(*args, **kwargs):   # the loss times a per-step factor: a chosen joint norm on each step
        out = forward(*args, **kwargs)
        out["loss"] = out["loss"] * scale[0]
        return out

    trainer.engine.forward = scaled
    backbone = _backbone_names(trainer)
    dense = set(_weights(trainer)) - backbone
    out = {"clip_after": [], "clip_saved": [], "coef_reported": [], "applied": []}
    # Step 1: joint norm 10 (clipped to 1 / 10) with the backbone's gradients boosted 30x, so that most of the norm
    # is the backbone's (a threshold rescaled by the dense share would be far below 1). Step 2: joint norm 0.9, no
    # clipping due: both sides must take coefficient 1.
    for target, boost in ((10.0, 30.0), (0.9, 1.0)):
        grads = _reference_gradients(cfg, trainer, world_size)
        grads.update({n: grads[n] * boost for n in backbone})
        scale[0] = target / math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        grads = {n: g * scale[0] for n, g in grads.items()}
        hooks = [backbone_param(m).register_hook(lambda g: g * boost) for m in trainer.backbone.values()]
        if boost == 1.0:   # what a checkpoint written by the old trainer loads: a threshold rescaled for one step
            trainer.engine.optimizer.clip_grad = 0.3
        before = _weights(trainer)
        metrics = trainer.train_step([_batch(rank)])
        trainer.step += 1
        for h in hooks:
            h.remove()
        after = _weights(trainer)
        out["clip_after"].append(trainer.engine.optimizer.clip_grad)
        out["clip_saved"].append(_saved_clip(trainer.save(), rank))
        out["coef_reported"].append(metrics["optim/clip_coef"])
        out["applied"].append({side: applied_coefficient(before, after, grads, names)
                               for side, names in (("dense", dense), ("backbone", backbone))})
    trainer.close()
    return out


def test_a_clipped_step_then_an_unclipped_one_give_both_sides_one_coefficient_and_keep_the_threshold(
        ranks2, data_dir, tmp_path):
    for r in ranks2.run(_clip_then_no_clip, data_dir, str(tmp_path)):
        for want, applied in zip((1 / (10 + 1e-6), 1.0), r["applied"]):
            assert applied["dense"] == pytest.approx(want, rel=1e-4), r["applied"]
            assert applied["backbone"] == pytest.approx(want, rel=1e-4), r["applied"]
        assert r["coef_reported"] == [pytest.approx(1 / (10 + 1e-6), rel=1e-5), 1.0]
        assert r["clip_after"] == [1.0, 1.0], "DeepSpeed's threshold must stay train.grad_clip after every step"
        assert r["clip_saved"] == [1.0, 1.0], "every checkpoint must hold train.grad_clip"


def _state(trainer) -> dict[str, torch.Tensor]:
    """Every weight and every optimizer state tensor of both sides on this rank."""
    out = {f"model/{n}": t for n, t in _weights(trainer).items()}
    opt = trainer.engine.optimizer
    for i, part in enumerate(opt.single_partition_of_fp32_groups):
        out[f"ds_master/{i}"] = part.detach().clone()
        for key, t in opt.optimizer.state.get(part, {}).items():
            if torch.is_tensor(t):
                out[f"ds_state/{i}/{key}"] = t.detach().clone()
    for name, master in trainer.matrix.masters.items():
        out[f"master/{name}"] = master.clone()
        out.update({f"state/{name}/{k}": v.clone() for k, v in trainer.matrix.states[name].items()})
    return out


def _backbone_nan(rank, world_size, data_dir, out_dir, overrides, bf16_overflow_check):
    from distsparse.models import backbone_param
    cfg, trainer = _trainer(data_dir, out_dir, overrides, bf16_overflow_check=bf16_overflow_check)
    trainer.train_step([_batch(rank)])   # a normal step first: Adam state exists on both sides
    trainer.step += 1
    before = _state(trainer)
    name = sorted(trainer.backbone)[0]
    handle = None
    if rank == 1:   # one rank, one backbone matrix: the dense side's gradients stay finite
        handle = backbone_param(trainer.backbone[name]).register_hook(lambda g: torch.full_like(g, float("nan")))
    metrics = trainer.train_step([_batch(rank)])
    trainer.step += 1
    if handle is not None:
        handle.remove()
    skipped = _state(trainer)
    trainer.train_step([_batch(rank)])
    trainer.step += 1
    after = _state(trainer)
    dense_lr = trainer.engine.optimizer.param_groups[0]["lr"] / cfg.train.lr   # what the next step applies
    trainer.close()
    changed = [k for k in before if not torch.equal(before[k], skipped[k])]
    return {"changed_by_skip": changed, "skipped_metric": metrics.get("optim/skipped_steps"),
            "finite_after": all(bool(torch.isfinite(t).all()) for t in after.values() if t.is_floating_point()),
            "trained_after": [k for k in before if k.startswith("model/") and not torch.equal(skipped[k], after[k])],
            "num_model": sum(k.startswith("model/") for k in before), "dense_lr_factor": dense_lr,
            "backbone_lr_factor": trainer.lr_scale(), "step": trainer.step}


# bf16 ZeRO-2 with DeepSpeed's own overflow check off is where a NaN threshold used to reach the dense weights.
@pytest.mark.parametrize("dtype,grad_clip,bf16_overflow_check",
                         [("fp32", "1.0", None), ("fp32", "0.0", None), ("bf16", "1.0", False), ("bf16", "0.0", False)])
def test_a_backbone_only_nan_skips_both_sides_with_every_weight_bit_identical(ranks2, data_dir, tmp_path, dtype,
                                                                              grad_clip, bf16_overflow_check):
    overrides = [f"train.dtype={dtype}", f"train.grad_clip={grad_clip}"]
    for r in ranks2.run(_backbone_nan, data_dir, str(tmp_path), overrides, bf16_overflow_check):
        assert r["changed_by_skip"] == [], f"the skipped step changed {r['changed_by_skip'][:5]}"
        assert r["skipped_metric"] == 1.0
        assert r["finite_after"], "the next step must start from clean buffers"
        assert len(r["trained_after"]) == r["num_model"], "the next step trains every parameter again"
        assert r["step"] == 3 and r["dense_lr_factor"] == pytest.approx(r["backbone_lr_factor"], rel=1e-9), \
            "after a skipped step both sides stay on one step of the schedule"


def _count_step_collectives(rank, world_size, data_dir, out_dir, overrides):
    import torch.distributed as dist
    _, trainer = _trainer(data_dir, out_dir, overrides)
    trainer.train_step([_batch(rank)])   # warm: lazy state
    trainer.step += 1
    seen = {"small_all_reduce": 0, "vector_norm": 0}
    real_all_reduce, real_norm = dist.all_reduce, torch.linalg.vector_norm

    def all_reduce(tensor, *args, **kwargs):
        if tensor.numel() <= 16:
            seen["small_all_reduce"] += 1
        return real_all_reduce(tensor, *args, **kwargs)

    def vector_norm(*args, **kwargs):
        seen["vector_norm"] += 1
        return real_norm(*args, **kwargs)

    dist.all_reduce, torch.linalg.vector_norm = all_reduce, vector_norm
    try:
        metrics = trainer.train_step([_batch(rank)])   # not a logging step (log_interval 1000), no refresh
    finally:
        dist.all_reduce, torch.linalg.vector_norm = real_all_reduce, real_norm
    trainer.close()
    return seen, metrics


@pytest.mark.parametrize("grad_clip", ["1.0", "0.0"])
def test_the_step_scalars_travel_in_one_all_reduce_and_no_norm_is_computed_without_clipping(
        ranks2, data_dir, tmp_path, grad_clip):
    for seen, metrics in ranks2.run(_count_step_collectives, data_dir, str(tmp_path),
                                    ["train.dtype=fp32", f"train.grad_clip={grad_clip}"]):
        assert seen["small_all_reduce"] == 1, seen
        if grad_clip == "0.0":
            assert seen["vector_norm"] == 0 and "optim/grad_norm" not in metrics, (seen, metrics)
        else:
            assert seen["vector_norm"] > 0 and metrics["optim/grad_norm"] > 0


PATCHED = ("scaled_global_norm", "check_overflow")


def _dense_step_raises(rank, world_size, data_dir, out_dir):
    _, trainer = _trainer(data_dir, out_dir, ["train.dtype=bf16", "train.grad_clip=1.0"], bf16_overflow_check=False)
    opt = trainer.engine.optimizer
    step = trainer.engine.step
    seen = {}

    def failing():   # DeepSpeed's step fails after the joint step has set it up
        seen.update(patched=[k for k in PATCHED if k in vars(opt)], check=opt.check_grad_overflow)
        opt.clip_grad = 123.0
        raise RuntimeError("injected failure inside DeepSpeed's step")

    trainer.engine.step = failing
    try:
        trainer.train_step([_batch(rank)])
    except RuntimeError as err:
        seen["error"] = str(err)
    trainer.engine.step = step
    restored = {"patched": [k for k in PATCHED if k in vars(opt)], "check": opt.check_grad_overflow,
                "clip": opt.clip_grad}
    trainer.close()
    return seen, restored


def test_deepspeeds_optimizer_is_restored_even_when_its_step_fails(ranks2, data_dir, tmp_path):
    for seen, restored in ranks2.run(_dense_step_raises, data_dir, str(tmp_path)):
        assert seen == {"patched": list(PATCHED), "check": True, "error": "injected failure inside DeepSpeed's step"}
        assert restored == {"patched": [], "check": False, "clip": 1.0}


def _micro_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    return [_batch(rank), _batch(rank + 2)]   # two micro-batches per rank, four distinct ones over both ranks


def _reported_loss_and_norm(rank, world_size, data_dir, out_dir):
    """One logged step with clipping off and two micro-batches per rank: what the step reports, and a float64
    reference of the model loss and of the joint gradient norm over all four micro-batches, from a fresh copy."""
    from distsparse.models import build_model
    cfg, trainer = _trainer(data_dir, out_dir, ["train.dtype=fp32", "train.grad_clip=0.0", "train.grad_accum=2",
                                                "train.log_interval=1"])
    model = build_model(cfg.model, cfg.method, VOCAB, cfg.train.seed).double()
    model.load_state_dict(trainer.model.state_dict())
    batches = [b for r in range(world_size) for b in _micro_batches(r)]
    losses = []
    for batch in batches:
        loss = model(**batch).loss / len(batches)
        loss.backward()
        losses.append(float(loss) * len(batches))
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters() if p.grad is not None))
    metrics = trainer.train_step(_micro_batches(rank))
    trainer.close()
    return {"loss": metrics["loss/train"], "norm": metrics.get("optim/grad_norm"), "report": trainer.report.loss,
            "ref_loss": sum(losses) / len(losses), "ref_norm": norm}


def test_a_logged_step_reports_the_mean_model_loss_and_the_joint_norm_even_with_clipping_off(
        ranks2, data_dir, tmp_path):
    for r in ranks2.run(_reported_loss_and_norm, data_dir, str(tmp_path)):
        assert r["loss"] == r["report"] == pytest.approx(r["ref_loss"], rel=1e-5), r
        assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-4), r


def _schedule_of_both_sides(rank, world_size, data_dir, out_dir):
    """Per step (1-based): the learning rate DeepSpeed applies, the one the backbone rule gets, and whether the
    backbone step was handed a topology refresh."""
    cfg, trainer = _trainer(data_dir, out_dir, ["train.dtype=fp32", "train.warmup_steps=3",
                                                "method.topology.update_interval=2"])
    seen = {"dense": [], "backbone": [], "refreshed": []}
    step = trainer.matrix.step

    def recording(lr, clip_coef=1.0, refresh=None, **kwargs):
        seen["backbone"].append(lr / cfg.method.lr)
        seen["refreshed"].append(refresh is not None)
        return step(lr, clip_coef, refresh, **kwargs)

    trainer.matrix.step = recording
    for _ in range(cfg.train.steps):
        seen["dense"].append(trainer.engine.optimizer.param_groups[0]["lr"] / cfg.train.lr)
        trainer.train_step([_batch(rank)])
        trainer.step += 1
    trainer.close()
    return seen


def test_both_sides_follow_one_schedule_and_refreshes_fall_on_every_interval_until_t_end(ranks2, data_dir, tmp_path):
    for r in ranks2.run(_schedule_of_both_sides, data_dir, str(tmp_path)):
        assert len(r["dense"]) == 6 and len(set(r["dense"])) == 5, "warmup, then decay: the factor moves"
        assert r["backbone"] == pytest.approx(r["dense"], rel=1e-6), "the same step of the schedule on both sides"
        # update_interval 2, T_end = int(0.75 * 6) = 4: steps 2 and 4 refresh, none after T_end.
        assert [s for s, done in enumerate(r["refreshed"], start=1) if done] == [2, 4]


def _refresh_metrics_of_two_ranks(rank, world_size):
    from distsparse.train.topology_policy import refresh_metrics
    stats = {f"model.layers.{rank}.self_attn.q_proj": {"groups_selected": 10.0 * (rank + 1),
                                                        "groups_changed": 2.0 * (rank + 1), "mpr_exclusions": rank,
                                                        "links_changed": 5.0, "zeta": 0.3, "temperature": 2.0}}
    return refresh_metrics(stats, seconds=0.1 * (rank + 1))


def test_refresh_metrics_sum_counts_over_ranks_and_keep_the_step_s_zeta(ranks2):
    for out in ranks2.run(_refresh_metrics_of_two_ranks):
        assert out == pytest.approx({
            "topology/refresh_s": 0.2, "topology/q_proj/groups_selected": 30.0,
            "topology/q_proj/effective_refresh_rate": 6.0 / 30.0, "topology/q_proj/mpr_exclusions": 1.0,
            "topology/q_proj/links_changed": 10.0, "topology/zeta": 0.3, "topology/temperature": 2.0})


def _resume_with_another_clip(rank, world_size, data_dir, out_dir):
    """Save with train.grad_clip 1.0, resume with 0.5 and save again before any step (a finished run resumed
    with save_at_end does exactly this)."""
    _, trainer = _trainer(data_dir, out_dir, ["train.dtype=fp32", "train.grad_clip=1.0"])
    trainer.train_step([_batch(rank)])
    trainer.step += 1
    trainer.save()
    trainer.close()
    _, resumed = _trainer(data_dir, out_dir, ["train.dtype=fp32", "train.grad_clip=0.5", "checkpoint.resume=auto"])
    out = {"step": resumed.step, "loaded": resumed.engine.optimizer.clip_grad}
    out["saved"] = _saved_clip(resumed.save(), rank)
    resumed.close()
    return out


def test_a_resume_holds_deepspeeds_threshold_at_this_runs_grad_clip_before_any_step(ranks2, data_dir, tmp_path):
    for r in ranks2.run(_resume_with_another_clip, data_dir, str(tmp_path)):
        assert r == {"step": 1, "loaded": 0.5, "saved": 0.5}, "DeepSpeed's load_checkpoint restores the saved one"
