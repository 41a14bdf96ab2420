"""Config errors name the key, the value and what is allowed, before any process group starts."""

import json

import pytest

from distsparse.config import load_config
from distsparse.train.deepspeed.config import build_ds_config
from distsparse.train.validate import validate, validate_without_data


@pytest.mark.parametrize("override, words", [
    ("train.stepz=3", ["train.stepz", "allowed in train"]),
    ("train.steps=abc", ["train.steps", "'abc'", "int"]),
    ("method.sparsity=3:5", ["method.sparsity", "'3:5'", "1:4, 2:4, 3:4"]),
    ("method.layout=diag", ["method.layout", "'diag'", "row, block"]),
    ("method.rule=sgd", ["method.rule", "'sgd'", "tans"]),
    ("engine.mode=lazy", ["engine.mode", "'lazy'", "sharded, replicated"]),
    ("model.preset=2b", ["model.preset", "'2b'", "60m"]),
    ("method.sparsity=none", ["method.sparsity", "'none'", "backbone 'dense'"]),
    ("train.min_lr_ratio=2", ["train.min_lr_ratio", "2", "[0, 1]"]),
    ("train.beta1=1.5", ["train.beta1", "1.5", "[0, 1)"]),
    ("train.beta2=-1", ["train.beta2", "-1", "[0, 1)"]),
    ("train.weight_decay=-0.1", ["train.weight_decay", "-0.1", ">= 0"]),
    ("train.eval_samples=-5", ["train.eval_samples", "-5", ">= 0"]),
])
def test_bad_config_values_name_key_value_and_allowed(override, words):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    for word in words:
        assert word in str(err.value), (word, str(err.value))


@pytest.mark.parametrize("overrides, words", [
    (["method.preset=chtsnm_nobranch_1of4_row", "method.branch_lr=3e-3"],
     ["method.branch_lr", "0.003", "method.branch.kind 'none'", "allowed: null"]),
    (["method.preset=dense_adamw", "method.branch_weight_decay=0.1"],
     ["method.branch_weight_decay", "0.1", "method.branch.kind 'none'", "allowed: null"]),
    (["method.preset=chtsnm_1of4_row", "method.branch_lr=0"], ["method.branch_lr", "0.0", "> 0"]),
    (["method.preset=chtsnm_1of4_row", "method.branch_lr=-1e-3"], ["method.branch_lr", "-0.001", "> 0"]),
    (["method.preset=chtsnm_1of4_row", "method.branch_lr=.nan"], ["method.branch_lr", "nan", "finite"]),
    (["method.preset=chtsnm_1of4_row", "method.branch_weight_decay=-0.1"],
     ["method.branch_weight_decay", "-0.1", ">= 0"]),
])
def test_a_branch_rate_is_refused_without_a_branch_or_when_not_positive(overrides, words):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_a_branch_rate_of_its_own_is_accepted_with_a_branch_and_null_keeps_one_group():
    own = load_config(None, ["method.preset=chtsnm_1of4_row", "method.branch_lr=3e-3",
                             "method.branch_weight_decay=0"]).method
    assert (own.branch_lr, own.branch_weight_decay, own.separate_branch_group) == (3e-3, 0.0, True)
    assert not load_config(None, ["method.preset=chtsnm_1of4_row"]).method.separate_branch_group


def test_quotes_are_not_needed_for_sparsity_in_overrides():
    assert load_config(None, ["method.sparsity=2:4", "train.lr=1e-3"]).method.spec.n == 2


def _data_dir(tmp_path, vocab=300, mode="packed", seq_len=64):
    meta = {"vocab_size": vocab, "mode": mode, "seq_len": seq_len, "dtype": "uint16",
            "num_tokens": {"train": 1000, "val": 100}, "eos_id": 2, "pad_id": 3}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return str(tmp_path)


def test_missing_data_dir_is_refused_with_the_prepare_command(tmp_path):
    cfg = load_config(None, [f"data.dir={tmp_path / 'nope'}"])
    with pytest.raises(ValueError, match="data.dir.*nope.*data_prep.prepare"):
        validate(cfg)


def test_data_vocab_above_the_model_vocab_is_refused(tmp_path):
    cfg = load_config(None, [f"data.dir={_data_dir(tmp_path, vocab=300)}", "model.vocab_size=256"])
    with pytest.raises(ValueError, match="model.vocab_size: got 256.*vocab 300"):
        validate(cfg)


def test_seq_len_above_max_positions_is_refused(tmp_path):
    cfg = load_config(None, [f"data.dir={_data_dir(tmp_path)}", "data.seq_len=4096"])
    with pytest.raises(ValueError, match="data.seq_len: got 4096.*max_position_embeddings"):
        validate(cfg)
    planned = load_config(None, [f"data.dir={tmp_path / 'elsewhere'}", "data.seq_len=4096", "model.vocab_size=256"])
    with pytest.raises(ValueError, match="data.seq_len: got 4096.*max_position_embeddings"):
        validate_without_data(planned, 64)   # a --dry-run planning a run whose data is not here


def test_widths_not_divisible_by_four_are_refused(tmp_path):
    cfg = load_config(None, [f"data.dir={_data_dir(tmp_path)}", "model.hidden_size=66", "model.num_attention_heads=1"])
    with pytest.raises(ValueError, match="model.hidden_size.*66.*multiple of 4"):
        validate(cfg)


def test_zero3_is_refused_with_the_reason(tmp_path):
    path = tmp_path / "z3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ValueError, match="zero_optimization.stage: got 3; allowed: 1, 2.*ZeRO-3"):
        build_ds_config(path, load_config(None, []))


def test_conflicting_batch_size_in_the_deepspeed_file_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 99}))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu: got 99"):
        build_ds_config(path, load_config(None, ["train.micro_batch=4"]))


def test_shipped_deepspeed_configs_resolve():
    for name in ("zero1", "zero2"):
        ds = build_ds_config(f"configs/ds/{name}.json", load_config(None, ["train.micro_batch=4", "train.dtype=fp32"]))
        assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["optimizer"]["params"]["torch_adam"]
