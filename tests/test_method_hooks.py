"""Method hooks (DESIGN decision 18): which hooks a built model gets, and what each adds to the generic step,
checked against the layers' own definitions (SR-STE decay per step, CAST's mask schedule and projection cut,
Add+Align's aux loss, ShuffleSparse's penalty and hardening)."""

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from distsparse.config import load_config
from distsparse.layers.branches import mean_aux_loss
from distsparse.layers.dense_latent import DenseLatentLinear, cast_metrics
from distsparse.layers.permutation import BlockPermutation
from distsparse.models import backbone_modules, build_model
from distsparse.nm import NMSpec
from distsparse.train.method_hooks import (
    AuxLossHooks, CASTHooks, PermutationHooks, SRSTEHooks, build_method_hooks,
)
from distsparse.train.permutation_policy import PermutationPolicy

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
METHOD_WORDS = re.compile(r"srste|sr_ste|cast|adams|add_?align|shuffle|permut|comolora|lora|prod_?gate|mpr", re.I)


def _built(preset: str, *extra: str):
    cfg = load_config(None, ["model.preset=tiny", "model.num_hidden_layers=1", f"method.preset={preset}", *extra])
    model = build_model(cfg.model, cfg.method, 64, seed=0)
    return cfg, model, backbone_modules(model)


@pytest.mark.parametrize("preset,extra,kinds", [
    ("chtsnm_nobranch_1of4_row", (), []),
    ("srste_1of4_row", (), [SRSTEHooks]),
    ("cast_1of4_row", (), [CASTHooks]),
    ("chtsnm_add_align1_1of4_row", (), [AuxLossHooks]),
    ("chtsnm_como1_1of4_row", (), []),
    ("chts24_1of4_row", ("method.permutation.mode=learned", "method.permutation.block_size=16"), [PermutationHooks]),
])
def test_each_built_model_gets_the_hooks_of_what_it_contains(preset, extra, kinds):
    cfg, model, backbone = _built(preset, *extra)
    hooks = build_method_hooks(model, backbone, cfg.method, micro_batches=1, total_steps=10)
    assert [type(h) for h in hooks.hooks] == kinds


def test_srste_hook_makes_k_micro_batches_decay_once_per_step():
    spec = NMSpec(2, 4, "row")
    gen = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(5, 16, generator=gen, dtype=F64), torch.randn(5, 8, generator=gen, dtype=F64)
    one, four = (DenseLatentLinear(16, 8, spec, "srste", lambda_w=1e-2, dtype=F64, init_std=1.0) for _ in range(2))
    SRSTEHooks([four], micro_batches=4)
    one(x).backward(upstream)
    for _ in range(4):   # DeepSpeed divides each micro-batch's loss by the accumulation count
        four(x).backward(upstream / 4)
    torch.testing.assert_close(four.weight.grad, one.weight.grad, rtol=1e-12, atol=1e-15)
    pruned = ~one.current_mask()
    assert (one.weight.grad[pruned] != 0).all()


def test_cast_hook_updates_masks_on_its_interval_and_reports_the_projection_cut():
    _, model, backbone = _built("cast_1of4_row", "method.latent_args={num_scale_groups: 2, mask_update_interval: 3}")
    layers = [m for m in backbone.values() if isinstance(m, DenseLatentLinear)]
    hooks = build_method_hooks(model, backbone, micro_batches=1)
    for layer in layers:
        with torch.no_grad():
            layer.weight.mul_(torch.rand(layer.weight.shape, generator=torch.Generator().manual_seed(1)))
    stale = [layer.current_mask().clone() for layer in layers]
    hooks.before_step(4)
    assert all(torch.equal(layer.current_mask(), s) for layer, s in zip(layers, stale)), "4 is not a multiple of 3"
    hooks.before_step(6)
    fresh = [layer.export_mask() for layer in layers]   # the projection of the current scaled weight
    assert all(torch.equal(layer.current_mask(), f) for layer, f in zip(layers, fresh))
    assert not all(torch.equal(s, f) for s, f in zip(stale, fresh))
    assert hooks.metrics() == cast_metrics(layers) and 0 < hooks.metrics()["cast/projection_cut"] < 1


def test_aux_loss_and_permutation_penalty_are_summed_into_the_extra_loss():
    cfg, model, backbone = _built("chtsnm_add_align1_1of4_row", "method.permutation.mode=learned",
                                  "method.permutation.block_size=16", "method.permutation.lambda_max=0.5")
    policy = PermutationPolicy(cfg.method.permutation, model, 10)
    hooks = build_method_hooks(model, backbone, cfg.method, micro_batches=1, total_steps=10)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x)
    aux, penalty = mean_aux_loss(model), policy.penalty(3)
    assert aux is not None and penalty is not None and float(penalty.detach()) > 0
    torch.testing.assert_close(hooks.extra_loss(3), aux + penalty, rtol=1e-6, atol=0)
    assert hooks.after_step(10)["permutation/qkv/fraction_hardened"] == 1.0, "every block hard at T_perm"


@pytest.mark.parametrize("mode", ["learned", "random"])
def test_the_hooks_name_the_learned_permutations_a_checkpoint_keeps(mode):
    cfg, model, backbone = _built("chts24_1of4_row", f"method.permutation.mode={mode}",
                                  "method.permutation.block_size=16")
    learned = {n: m for n, m in model.named_modules() if isinstance(m, BlockPermutation) and m.mode == "learned"}
    saved = build_method_hooks(model, backbone, cfg.method, micro_batches=1, total_steps=10).saved_state()
    assert saved.keys() == learned.keys() and all(saved[n] is m for n, m in learned.items())
    assert (len(saved) > 0) == (mode == "learned")   # random permutations are rebuilt from the seed


@pytest.mark.parametrize("path", ["distsparse/train/trainer.py", "distsparse/train/joint_step.py",
                                  "distsparse/train/deepspeed/side.py", "distsparse/optim/engine.py"])
def test_the_loop_the_joint_step_and_the_engine_hold_no_method_names(path):
    """Identifiers only (comments and docstrings may name the methods a phase serves)."""
    tokens = tokenize.generate_tokens(io.StringIO((ROOT / path).read_text()).readline)
    named = sorted({t.string for t in tokens if t.type == tokenize.NAME and METHOD_WORDS.search(t.string)})
    assert named == [], f"{path} names methods: {named}; methods plug in through train/method_hooks.py"
