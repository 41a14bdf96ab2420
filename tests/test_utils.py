"""distsparse/utils.py: the dotted-key view of a config that checkpoint compatibility, TensorBoard hparams and
the benchmark tools compare and report by."""

from distsparse.utils import ABSENT, config_differences, flatten_config


def test_a_nested_config_becomes_dotted_keys_and_an_empty_section_stays_a_value():
    config = {"train": {"lr": 3e-3, "out_dir": "runs/x"}, "method": {"name": "chtsnm", "branch": {"kind": None}},
              "overrides": {}, "seed": 0, "sizes": [1, 2]}
    assert flatten_config(config) == {"train.lr": 3e-3, "train.out_dir": "runs/x", "method.name": "chtsnm",
                                      "method.branch.kind": None, "overrides": {}, "seed": 0, "sizes": [1, 2]}


def test_differences_are_the_changed_added_and_removed_dotted_keys_sorted_and_none_differs_from_absent():
    old = {"train": {"lr": 3e-3, "steps": 1500, "gone": 1}, "method": {"branch": {"kind": None}}, "seed": 0}
    new = {"train": {"lr": 6e-3, "steps": 1500}, "method": {"branch": {}}, "seed": 0, "added": [1]}
    assert list(config_differences(old, new).items()) == [
        ("added", (ABSENT, [1])), ("method.branch", (ABSENT, {})), ("method.branch.kind", (None, ABSENT)),
        ("train.gone", (1, ABSENT)), ("train.lr", (3e-3, 6e-3))]
    assert config_differences(old, old) == {}
