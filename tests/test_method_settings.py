"""Typed method settings are checked when the config is built, before any process starts: rule hyperparameters,
refresh parameters, dense-latent options and the optimizer-state reset mode (paper Table A8). Every error names the
key, the value and what is allowed. The Table A6 / A7 / A8 presets carry exactly their table's row."""

import pytest

from distsparse.config import CONFIG_ROOT, check_backbone_shapes, load_config
from distsparse.layers.dense_latent import LatentParams
from distsparse.optim.hparams import TansHParams
from distsparse.topology import RefreshParams


@pytest.mark.parametrize("override,message", [
    ("method.rule_args={beta1: 1.5}", r"method\.rule_args\.beta1: got 1\.5; allowed: 0 <= beta1 < 1"),
    ("method.rule_args={ramp_step: 4}",
     r"method\.rule_args: got unknown key 'ramp_step'; allowed: beta1, .*ramp_steps"),
    ("method.rule_args={ramp_steps: four}", r"method\.rule_args\.ramp_steps: got 'four' \(str\); allowed: .*int"),
    ("method.rule_args={lr: 0.1}", r"method\.rule_args: got key 'lr', which comes from .*method\.lr"),
    ("method.topology.args={mpr_rho: 2}", r"method\.topology\.args\.mpr_rho: got 2\.0; allowed: null .* 0 <= rho <= 1"),
    ("method.topology.args={zeta: 0.1}", r"method\.topology\.args: got unknown key 'zeta'; allowed: zeta0"),
    ("method.latent_args={lambda_w: 0.1}", r"method\.latent_args\.lambda_w: got 0\.1 with method\.backbone 'sparse'; "
                                           r"allowed: only with backbone srste"),
    ("method.reset_mode=some", r"method\.reset_mode: got 'some'; allowed: changed, all, none"),
])
def test_bad_method_settings_fail_at_config_build_naming_key_value_and_allowed(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, ["method.preset=chtsnm_nobranch_1of4_row", override])


def test_latent_options_are_checked_against_the_backbone_and_their_range():
    with pytest.raises(ValueError, match=r"method\.latent_args\.mask_update_interval: got 0; allowed: an integer >= 1"):
        load_config(None, ["method.preset=cast_1of4_row", "method.latent_args={mask_update_interval: 0}"])
    with pytest.raises(ValueError, match=r"method\.latent_args\.num_scale_groups: got 2 with method\.backbone 'srste'"):
        load_config(None, ["method.preset=srste_1of4_row", "method.latent_args={num_scale_groups: 2}"])
    assert load_config(None, ["method.preset=srste_1of4_row"]).method.latent_params == LatentParams(lambda_w=1e-4)


def test_reset_modes_other_than_changed_need_refreshes_of_a_sparse_backbone():
    with pytest.raises(ValueError, match=r"method\.reset_mode: got 'none' with method\.backbone 'srste'"):
        load_config(None, ["method.preset=srste_1of4_row", "method.reset_mode=none"])
    cfg = load_config(None, ["method.preset=tans_ramp8_1of4_row", "method.reset_mode=none"])
    assert cfg.method.reset_mode == "none"


def test_typed_settings_carry_the_config_values():
    cfg = load_config(None, ["method.preset=chtsnm_nobranch_1of4_row", "method.lr=0.002",
                             "method.rule_args={gamma_ns: 0.75, rms_mode: none}",
                             "method.topology.args={mpr_rho: null}"])
    assert cfg.method.rule_params == TansHParams(lr=0.002, gamma_ns=0.75, rms_mode="none")
    assert cfg.method.topology.params == RefreshParams(mpr_rho=None)


@pytest.mark.parametrize("preset,row", [
    ("tans_rms_none_g0p75_1of4_row", {"rms_mode": "none", "gamma_ns": 0.75}),
    ("tans_rms_pre_mask_global_g0p75_1of4_row", {"rms_mode": "pre_mask_global", "gamma_ns": 0.75}),
    ("tans_rms_post_mask_active_g0p75_1of4_row", {"rms_mode": "post_mask_active", "gamma_ns": 0.75}),
    ("tans_ramp2_1of4_row", {"ramp_steps": 2}),
])
def test_table_a6_gamma_0p75_and_table_a7_ramp_2_presets_hold_their_row(preset, row):
    assert (CONFIG_ROOT / "method" / f"{preset}.yaml").exists()
    cfg = load_config(None, [f"method.preset={preset}"])
    base = load_config(None, ["method.preset=tans_ramp8_1of4_row"])   # the same grid's default row (ramp 8)
    assert cfg.method.rule == "tans" and cfg.method.lr == 1e-3 and cfg.method.sparsity == "1:4"
    assert cfg.method.topology == base.method.topology
    assert cfg.method.rule_params == TansHParams(lr=1e-3, **row)


@pytest.mark.parametrize("mode", ["none", "all"])
@pytest.mark.parametrize("ramp", [0, 8])
def test_table_a8_presets_hold_their_reset_mode_and_ramp(mode, ramp):
    cfg = load_config(None, [f"method.preset=tans_reset_{mode}_ramp{ramp}_1of4_row"])
    changed = load_config(None, [f"method.preset=tans_ramp{ramp}_1of4_row"])   # the changed-entries row
    assert cfg.method.reset_mode == mode and changed.method.reset_mode == "changed"
    assert cfg.method.rule_params == changed.method.rule_params == TansHParams(lr=1e-3, ramp_steps=ramp)
    assert cfg.method.topology == changed.method.topology


def test_backbone_shapes_are_checked_for_every_projection_of_the_model():
    def check(*overrides):
        cfg = load_config(None, ["model.preset=tiny", *overrides])
        check_backbone_shapes(cfg.model, cfg.method)

    check("method.preset=chts24_1of4_block")   # 64 x 176: both widths multiples of 4
    check("method.preset=dense_adamw", "model.hidden_size=66", "model.num_attention_heads=3")   # dense: no rule
    with pytest.raises(ValueError, match=r"model\.hidden_size: in_features=66 is not divisible by 4"):
        check("method.preset=chts24_1of4_row", "model.hidden_size=66", "model.num_attention_heads=3")
    for layout in ("row", "block"):
        with pytest.raises(ValueError, match=r"model\.intermediate_size \(rounded to ffn_multiple_of\): "
                                             r"in_features=174 is not divisible by 4"):
            check(f"method.preset=chts24_1of4_{layout}", "model.intermediate_size=174", "model.ffn_multiple_of=2")
