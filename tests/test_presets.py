"""Every method preset loads, builds a tiny model and names its learning-rate source."""

import pytest
import torch

from distsparse.config import CONFIG_ROOT, load_config
from distsparse.models import backbone_modules, build_model

PRESETS = sorted(p.stem for p in (CONFIG_ROOT / "method").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_method_preset_builds_a_tiny_model(preset):
    cfg = load_config(None, ["model.preset=tiny", f"method.preset={preset}"])
    header = [line for line in (CONFIG_ROOT / "method" / f"{preset}.yaml").read_text().splitlines()
              if line.startswith("#")]
    assert any("lr" in line for line in header), "a preset states its learning rate and its source"
    cfg.method.rule_params, cfg.method.topology.params, cfg.method.latent_params   # typed settings build
    model = build_model(cfg.model, cfg.method, 64, seed=0)
    assert len(backbone_modules(model)) == 7 * cfg.model.num_hidden_layers
    x = torch.randint(0, 64, (1, 8))
    assert torch.isfinite(model(input_ids=x, labels=x).loss)


def test_paper_table_rows_exist():
    for name in ("dense_adamw", "dense_muon", "dense_tans", "chts_muon_1of4_row"):
        assert name in PRESETS
    for method in ("ste", "srste", "chts24", "chtsnm_nobranch", "chtsnm"):
        for s in ("1of4", "2of4"):
            for layout in ("row", "block"):
                assert f"{method}_{s}_{layout}" in PRESETS
    assert "cast_1of4_row" in PRESETS and "cast_1of4_block" not in PRESETS


def test_block_wise_cast_is_refused_with_the_papers_reason():
    cfg = load_config(None, ["model.preset=tiny", "method.preset=cast_1of4_row", "method.layout=block"])
    with pytest.raises(ValueError, match="block"):
        build_model(cfg.model, cfg.method, 64, seed=0)


def test_60m_at_one_percent_gives_rank_seven():
    from distsparse.models import branch_rank
    cfg = load_config(None, ["model.preset=60m", "method.preset=chtsnm_1of4_row"])
    assert branch_rank(cfg.model, cfg.method) == 7
