"""The strict loader under every config of the project: typed dataclasses from nested mappings, YAML read without
YAML 1.1's surprises, and `key=value` overrides. Knows no schema: distsparse.config (the run config), the
checkpoint manifest's config (distsparse.checkpoint.model), rule and refresh settings and the tools' own plans are
all built by it.

An unknown key or a value of the wrong type fails with a message naming the key, the value and what is allowed
(nanoGPT's configurator behaviour, torchtitan's dataclass layout); the dataclasses' own `__post_init__` checks
the values.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


def _typed_value(path: str, value: Any, tp: Any) -> Any:
    """`value` checked against the field type `tp` (`X | None` admits null), floats given as YAML strings read as
    numbers; ValueError naming `path`, the value and the type otherwise."""
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    if optional and value is None:
        return None
    tp = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp
    if tp is float and isinstance(value, str):
        try:
            value = float(value)   # YAML 1.1 reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    if not _type_ok(value, tp):
        raise ValueError(f"{path}: got {value!r} ({type(value).__name__}); allowed: a {tp.__name__}"
                         f"{' or null' if optional else ''}")
    return float(value) if tp is float else value


def build_dataclass(cls: type, data: dict, prefix: str) -> Any:
    """Instantiate `cls` from a nested dict; unknown keys and wrong types raise ValueError."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'}: got {data!r}; allowed: a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ValueError(f"unknown config key {path!r}; allowed in {prefix or 'the top level'}: "
                             f"{', '.join(sorted(names))}")
        tp = hints[key]
        kwargs[key] = build_dataclass(tp, value, path) if dataclasses.is_dataclass(tp) else _typed_value(path, value, tp)
    return cls(**kwargs)


def build_settings(cls: type, data: dict, key: str, **fixed: Any) -> Any:
    """A typed settings dataclass (rule hyperparameters, refresh parameters, latent options) from the mapping under
    config key `key`: an unknown key, a wrong type or a bad value fails naming `key.field`, the value and what is
    allowed. `fixed` fields come from elsewhere in the config and may not be given in `data`."""
    allowed = [f.name for f in dataclasses.fields(cls) if f.name not in fixed]
    if not isinstance(data, dict):
        raise ValueError(f"{key}: got {data!r}; allowed: a mapping with keys {', '.join(allowed)}")
    hints = typing.get_type_hints(cls)
    kwargs = dict(fixed)
    for name, value in data.items():
        if name in fixed:
            raise ValueError(f"{key}: got key {name!r}, which comes from elsewhere in the config (method.{name}); "
                             f"allowed: {', '.join(allowed)}")
        if name not in allowed:
            raise ValueError(f"{key}: got unknown key {name!r}; allowed: {', '.join(allowed)}")
        kwargs[name] = _typed_value(f"{key}.{name}", value, hints[name])
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ValueError(f"{key}.{err}") from None


# ---- YAML ----------------------------------------------------------------------------------------------------

class _YamlLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's base-60 integers, so `sparsity: 1:4` stays the string '1:4'."""


_YamlLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:int"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))


def read_yaml(text: str, source: str = "YAML", allowed: str = "a YAML mapping") -> Any:
    """Parsed YAML; ValueError naming `source` (a file or an override) and where the text stops being YAML."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{source}: not valid YAML{where}: {problem}; allowed: {allowed}") from None


def read_yaml_file(path: Path, source: str, allowed: str = "a YAML mapping") -> Any:
    """A YAML file's content; ValueError naming `source` and the file when it cannot be read or parsed (`allowed`:
    what the file should hold, for the message)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ValueError(f"{source}: cannot read {str(path)!r} ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{source}: {str(path)!r} is not UTF-8 text (byte {err.start}); allowed: a YAML "
                         f"file") from None
    return read_yaml(text, f"{source} {path}", allowed)


# ---- overrides -----------------------------------------------------------------------------------------------

def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` on top; nested mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def parse_override(item: str) -> dict:
    """`train.steps=100` -> {"train": {"steps": 100}}; the value is read as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ValueError(f"override {item!r}: expected key=value, e.g. train.steps=100")
    key, text = item.split("=", 1)
    value = read_yaml(text, f"override {item!r}", "a YAML value, e.g. train.steps=100 or train.lr=1e-3") \
        if text else ""
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return value
