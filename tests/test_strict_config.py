"""The strict loader alone (distsparse.strict_config), on dataclasses of its own: what it builds, what it refuses
and how each refusal names the key, and that it knows nothing of the run config's schema."""

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from distsparse.strict_config import (
    build_dataclass, build_settings, deep_merge, parse_override, read_yaml, read_yaml_file,
)

ROOT = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True)
class Inner:
    rate: float = 0.5
    note: str | None = None

    def __post_init__(self) -> None:
        if self.rate < 0:
            raise ValueError(f"rate: got {self.rate}; allowed: >= 0")


@dataclass(kw_only=True)
class Outer:
    count: int = 1
    flag: bool = False
    extra: dict = field(default_factory=dict)
    inner: Inner = field(default_factory=Inner)


@dataclass(kw_only=True)
class Settings:
    lr: float = 1.0
    beta: float = 0.9

    def __post_init__(self) -> None:
        if not 0 <= self.beta < 1:
            raise ValueError(f"beta: got {self.beta}; allowed: [0, 1)")


def test_build_dataclass_builds_nested_sections_with_typed_values():
    out = build_dataclass(Outer, {"count": 3, "extra": {"a": 1}, "inner": {"rate": "1e-3", "note": None}}, "")
    assert out == Outer(count=3, extra={"a": 1}, inner=Inner(rate=0.001, note=None))
    assert isinstance(build_dataclass(Inner, {"rate": 2}, "inner").rate, float)   # an int is a float here


@pytest.mark.parametrize("data, message", [
    ({"cout": 3}, "unknown config key 'cout'; allowed in the top level: count, extra, flag, inner"),
    ({"inner": {"rte": 1}}, "unknown config key 'inner.rte'; allowed in inner: note, rate"),
    ({"count": True}, "count: got True (bool); allowed: a int"),          # a bool is no int
    ({"count": 2.0}, "count: got 2.0 (float); allowed: a int"),
    ({"inner": {"rate": "fast"}}, "inner.rate: got 'fast' (str); allowed: a float"),
    ({"inner": {"note": 3}}, "inner.note: got 3 (int); allowed: a str or null"),
    ({"inner": 5}, "inner: got 5; allowed: a mapping of keys to values"),
])
def test_build_dataclass_refuses_naming_the_key(data, message):
    with pytest.raises(ValueError) as err:
        build_dataclass(Outer, data, "")
    assert str(err.value) == message


def test_build_settings_prefixes_the_key_and_keeps_fixed_fields_out_of_the_mapping():
    assert build_settings(Settings, {"beta": 0.5}, "method.rule_args", lr=0.1) == Settings(lr=0.1, beta=0.5)
    with pytest.raises(ValueError, match=r"^method\.rule_args\.beta: got 1\.5; allowed: \[0, 1\)$"):
        build_settings(Settings, {"beta": 1.5}, "method.rule_args", lr=0.1)
    with pytest.raises(ValueError, match=r"^method\.rule_args: got key 'lr', which comes from elsewhere .*"
                                         r"allowed: beta$"):
        build_settings(Settings, {"lr": 0.2}, "method.rule_args", lr=0.1)
    with pytest.raises(ValueError, match=r"^method\.rule_args: got unknown key 'gamma'; allowed: beta$"):
        build_settings(Settings, {"gamma": 1}, "method.rule_args", lr=0.1)


def test_yaml_keeps_ratios_as_strings_and_names_where_it_breaks(tmp_path):
    assert read_yaml("sparsity: 1:4\nsteps: 0x10\nn: 12\nlr: 1e-3") == \
        {"sparsity": "1:4", "steps": 16, "n": 12, "lr": "1e-3"}   # base-60 off; 1e-3 stays for the float field
    with pytest.raises(ValueError) as err:
        read_yaml("a: 1\nb: [2\nc: 3", "plan", "a plan")
    assert str(err.value) == ("plan: not valid YAML at line 3, column 2: expected ',' or ']', but got ':'; "
                              "allowed: a plan")
    bad = tmp_path / "x.yaml"
    bad.write_bytes(b"a: \xff\n")
    with pytest.raises(ValueError, match=r"^--plan: '.*x\.yaml' is not UTF-8 text \(byte 3\)"):
        read_yaml_file(bad, "--plan")
    with pytest.raises(ValueError, match=r"^--plan: cannot read '.*missing\.yaml'"):
        read_yaml_file(tmp_path / "missing.yaml", "--plan")


def test_overrides_nest_by_dots_and_merge_key_by_key():
    assert parse_override("train.steps=100") == {"train": {"steps": 100}}
    assert parse_override("method.sparsity=2:4") == {"method": {"sparsity": "2:4"}}
    assert parse_override("train.out_dir=") == {"train": {"out_dir": ""}}
    with pytest.raises(ValueError, match=r"override 'train\.steps': expected key=value"):
        parse_override("train.steps")
    base = {"train": {"steps": 1, "lr": 2}, "model": {"preset": "tiny"}}
    assert deep_merge(base, {"train": {"steps": 5}, "model": "x"}) == {"train": {"steps": 5, "lr": 2}, "model": "x"}
    assert base["train"]["steps"] == 1   # the base is not changed


def test_the_loader_imports_no_other_distsparse_module():
    tree = ast.parse((ROOT / "distsparse" / "strict_config.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | \
        {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.startswith("distsparse")}, imported
