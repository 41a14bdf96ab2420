"""distsparse/utils.py: the dotted-key view of a config that checkpoint compatibility, TensorBoard hparams and
the benchmark tools compare and report by."""

from distsparse.utils import flatten_config


def test_a_nested_config_becomes_dotted_keys_and_an_empty_section_stays_a_value():
    config = {"train": {"lr": 3e-3, "out_dir": "runs/x"}, "method": {"name": "chtsnm", "branch": {"kind": None}},
              "overrides": {}, "seed": 0, "sizes": [1, 2]}
    assert flatten_config(config) == {"train.lr": 3e-3, "train.out_dir": "runs/x", "method.name": "chtsnm",
                                      "method.branch.kind": None, "overrides": {}, "seed": 0, "sizes": [1, 2]}
