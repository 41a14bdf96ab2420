"""Joint gradient clipping across DeepSpeed and the matrix engine (DESIGN decisions 4, 18) on 2 gloo ranks.

The JointOptimizer steps a DeepSpeed ZeRO-1 or ZeRO-2 engine (dense side) and a MatrixEngine (backbone) after one
backward on rank-specific data. Its joint norm must equal the norm of the mean gradient over both ranks' batches,
computed in one process on an untouched copy of the model, and both sides must then apply the same coefficient.
The coefficient each side applied is read back from its update: on the first step, bias-corrected Adam moves a
weight by -lr c g / (c |g| + eps), which with eps = 1 depends on the clip c (with the default eps = 1e-8 the step
would be lr sign(g) whatever the clip). DeepSpeed's side runs torch AdamW, the backbone the engine's `adam` rule.
"""

import copy
import math
from pathlib import Path

import pytest
import torch

from adam_readback import applied_coefficient
from distsparse.config import load_config
from distsparse.train.deepspeed.config import build_ds_config

ROOT = Path(__file__).resolve().parents[1]
VOCAB, EPS, LR = 97, 1.0, 1.0
OVERRIDES = ["model.preset=tiny", "model.num_hidden_layers=1", "method.preset=chts24_1of4_row", "train.dtype=fp32",
             f"train.lr={LR}", "train.weight_decay=0.0", "train.micro_batch=2"]


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(50 + rank))


def _mean_gradients(model, world_size: int) -> dict[str, torch.Tensor]:
    """float64 mean over the ranks' batches of every parameter's gradient, in this process alone."""
    grads = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    for r in range(world_size):
        model.zero_grad()
        x = _batch(r)
        model(input_ids=x, labels=x).loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[n] += p.grad.double() / world_size
    return grads


def _clip_one_step(rank, world_size, max_norm, stage):
    import deepspeed

    from distsparse.models import backbone_modules, backbone_param, build_model
    from distsparse.optim import AdamHParams
    from distsparse.optim.engine import MatrixEngine
    from distsparse.train.joint_step import JointOptimizer
    from distsparse.train.trainer import dense_side_parameters

    cfg = load_config(None, OVERRIDES + [f"train.grad_clip={max_norm}"])
    ds_config = build_ds_config(ROOT / f"configs/ds/zero{stage}.json", cfg)
    ds_config["optimizer"]["params"]["eps"] = EPS
    model = build_model(cfg.model, cfg.method, VOCAB, seed=0)
    untouched = copy.deepcopy(model)
    backbone = backbone_modules(model)
    backbone_names = {n for n, p in model.named_parameters() if any(p is backbone_param(m) for m in backbone.values())}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=dense_side_parameters(model, backbone),
                                           config=ds_config)
    matrix = MatrixEngine(backbone, rule="adam", hparams=AdamHParams(lr=LR, eps=EPS))
    joint = JointOptimizer(engine, matrix, grad_clip=max_norm, backbone_lr=lambda step: LR)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    x = _batch(rank)
    joint.begin(0)
    joint.backward(engine(input_ids=x, labels=x).loss, last=True)
    report = joint.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}

    reference = _mean_gradients(untouched, world_size) if rank == 0 else None
    return {"total": report.grad_norm, "coef": report.clip_coef, "clip_after": engine.optimizer.clip_grad,
            "before": before, "after": after, "reference": reference, "backbone": backbone_names}


@pytest.mark.parametrize("stage", [1, 2])
def test_joint_clip_factor_equals_the_one_from_all_gradients_in_one_process(ranks2, stage):
    max_norm = 0.1
    r0, r1 = ranks2.run(_clip_one_step, max_norm, stage)
    ref = r0["reference"]
    ref_total = math.sqrt(sum(float(g.square().sum()) for g in ref.values()))
    ref_backbone = math.sqrt(sum(float(ref[n].square().sum()) for n in r0["backbone"]))
    ref_coef = max_norm / (ref_total + 1e-6)
    assert ref_coef < 0.5 and ref_backbone > 0.05 * ref_total, "the clip must bind and the backbone must count"

    for r in (r0, r1):
        assert r["total"] == pytest.approx(ref_total, rel=1e-5)
        assert r["coef"] == pytest.approx(ref_coef, rel=1e-5)
        assert r["clip_after"] == max_norm, "DeepSpeed's threshold stays train.grad_clip"

    # Each side's update reveals the coefficient it applied. A per-side clip (DeepSpeed by its own norm) would give
    # the dense side max_norm / ||dense grads||: the last assert shows the tolerance tells the two apart.
    dense_names = set(ref) - r0["backbone"]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= dense_names
    for r in (r0, r1):
        for side in (dense_names, r0["backbone"]):
            assert applied_coefficient(r["before"], r["after"], ref, side) == pytest.approx(ref_coef, rel=1e-5)
    ref_dense = math.sqrt(sum(float(ref[n].square().sum()) for n in dense_names))
    assert max_norm / ref_dense != pytest.approx(ref_coef, rel=1e-5)


def test_bf16_with_zero1_is_refused_by_the_deepspeed_config_builder():
    bf16 = load_config(None, ["train.dtype=bf16"])
    with pytest.raises(ValueError, match=r"zero_optimization.stage: got 1 with train.dtype bf16; allowed: 2"):
        build_ds_config(ROOT / "configs/ds/zero1.json", bf16)
    assert build_ds_config(ROOT / "configs/ds/zero2.json", bf16)["bf16"]["enabled"] is True
    fp32 = load_config(None, ["train.dtype=fp32"])
    assert build_ds_config(ROOT / "configs/ds/zero1.json", fp32)["zero_optimization"]["stage"] == 1
