"""The walking skeleton on 2 gloo ranks: DeepSpeed dense side + matrix engine backbone."""

import pytest
import torch

from distsparse.config import load_config
from distsparse.layers import NMSparseLinear
from distsparse.nm import decode
from distsparse.models import backbone_param
from distsparse.train.deepspeed.config import build_ds_config
from synthetic_data import make_data_dir

BASE = ["model.preset=tiny", "data.seq_len=32", "train.dtype=fp32", "train.eval_interval=1000",
        "train.log_interval=1000", "train.warmup_steps=0", "train.eval_samples=16"]


def _snapshot(trainer):
    dense = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
             if not any(p is backbone_param(m) for m in trainer.backbone.values())}
    backbone = {n: backbone_param(m).detach().clone() for n, m in trainer.backbone.items()}
    return dense, backbone


def _run(rank, world_size, data_dir, out_dir, overrides, steps):
    from distsparse.train.trainer import Trainer
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", f"train.steps={steps}"]
                      + overrides)
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    before = _snapshot(trainer)
    codes_before = {n: m.codes.clone() for n, m in trainer.backbone.items() if hasattr(m, "codes")}
    result = trainer.train()
    after = _snapshot(trainer)
    grads_left = [n for n, m in trainer.backbone.items() if backbone_param(m).grad is not None]
    masks_zero = all(bool((m.dense_weight()[~decode(m.meta)] == 0).all())
                     for m in trainer.backbone.values() if isinstance(m, NMSparseLinear))
    trainer.close()
    return {"before": before, "after": after, "grads_left": grads_left, "masks_zero": masks_zero,
            "result": result, "codes": {n: m.codes.clone() for n, m in trainer.backbone.items() if hasattr(m, "codes")},
            "codes_changed": any(not torch.equal(c, trainer.backbone[n].codes) for n, c in codes_before.items())}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


def test_two_ranks_train_both_sides_and_keep_backbones_identical(ranks2, data_dir, tmp_path):
    r0, r1 = ranks2.run(_run, data_dir, str(tmp_path), ["method.preset=chtsnm_nobranch_1of4_row",
                                                        "method.topology.update_interval=1"], 3)
    for name, value in r0["after"][1].items():
        assert torch.equal(value, r1["after"][1][name]), f"{name} differs between ranks"
        assert not torch.equal(value, r0["before"][1][name]), f"{name} did not train"
    for name, value in r0["after"][0].items():
        assert torch.equal(value, r1["after"][0][name]), f"dense {name} differs between ranks"
    changed = [n for n, v in r0["after"][0].items() if not torch.equal(v, r0["before"][0][n])]
    assert "model.embed_tokens.weight" in changed and "lm_head.weight" in changed
    assert r0["grads_left"] == [] and r1["grads_left"] == []
    assert r0["masks_zero"]
    for name, codes in r0["codes"].items():
        assert torch.equal(codes, r1["codes"][name]), f"{name}: masks differ between ranks after refreshes"
    assert r0["codes_changed"], "refreshes at steps 1 and 2 changed no mask"
    assert r0["result"].val_loss < 5.0 and r0["result"].val_ppl == pytest.approx(
        torch.tensor(r0["result"].val_loss).exp().item(), rel=1e-6)


# SR-STE with a large lambda_w: its decay must come once per step however many micro-batches make the step.
@pytest.mark.parametrize("method", [["method.preset=chts24_1of4_row"],
                                    ["method.preset=srste_1of4_row", "method.latent_args={lambda_w: 0.01}"]])
def test_gradient_accumulation_1x4_equals_4x1(ranks2, data_dir, tmp_path, method):
    method = method + ["train.grad_clip=0"]
    a = ranks2.run(_run, data_dir, str(tmp_path / "a"), method + ["train.micro_batch=4", "train.grad_accum=1"], 2)
    b = ranks2.run(_run, data_dir, str(tmp_path / "b"), method + ["train.micro_batch=1", "train.grad_accum=4"], 2)
    for part in (0, 1):
        for name, value in a[0]["after"][part].items():
            torch.testing.assert_close(value, b[0]["after"][part][name], rtol=1e-4, atol=1e-5, msg=name)


def _permuted(rank, world_size, data_dir, out_dir):
    from distsparse.layers.permutation import BlockPermutation
    from distsparse.train.trainer import Trainer
    from distsparse.data import collate
    cfg = load_config(None, BASE + [f"data.dir={data_dir}", f"train.out_dir={out_dir}", "train.steps=6",
                                    "method.preset=chts24_1of4_row", "method.permutation.mode=learned",
                                    "method.permutation.block_size=16", "method.permutation.t_perm_fraction=1.0",
                                    "method.permutation.lambda_max=0.1"])
    trainer = Trainer(cfg, build_ds_config("configs/ds/zero2.json", cfg))
    perms = {n: m for n, m in trainer.model.named_modules() if isinstance(m, BlockPermutation)}
    theta0 = {n: m.theta.detach().clone() for n, m in perms.items()}
    micro_batches = iter(trainer.sampler)
    for _ in range(3):   # 3 of 6 steps: T_perm = 6, so every block is still soft
        trainer.train_step([collate(trainer.train_data, next(micro_batches))])
        trainer.step += 1
    out = {}
    for name, perm in perms.items():
        soft = (~perm.hard_mask).nonzero().squeeze(1)
        blocks = perm.soft_blocks(soft).detach()
        out[name] = {"rows": blocks.sum(-1), "cols": blocks.sum(-2), "min": float(blocks.min()),
                     "theta": perm.theta.detach().clone(), "moved": not torch.equal(theta0[name], perm.theta)}
    trainer.close()
    return out


def test_learned_permutations_stay_doubly_stochastic_under_zero2(ranks2, data_dir, tmp_path):
    r0, r1 = ranks2.run(_permuted, data_dir, str(tmp_path))
    assert len(r0) == 2 * 4, "q/k/v share one permutation and gate/up share one: 4 per layer"
    for name, p in r0.items():
        assert p["moved"], f"{name}: theta did not train"
        torch.testing.assert_close(p["rows"], torch.ones_like(p["rows"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(p["cols"], torch.ones_like(p["cols"]), rtol=0, atol=1e-5)
        assert p["min"] >= 0
        assert torch.equal(p["theta"], r1[name]["theta"]), f"{name}: ranks disagree"
