"""The benchmarks' layout (issue 29): the loop is measured from inside, not patched; no user tool imports another
tool; every benchmark in bench/ takes the harness's settings (a quick preset and strict key=value overrides)."""

import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from bench.core import Settings, parse

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "tools").glob("*.py")])
BENCHMARKS = ("checkpoint", "data", "estimate_h200", "inference", "layer", "optimizer", "permutation", "scale_check",
              "topology", "train")
ROOTS = {"trainer", "engine", "ds_engine", "joint", "matrix", "side", "deepspeed"}


def patches(text: str) -> list[str]:
    """Assignments to an attribute of the trainer, its engines or DeepSpeed's objects (`trainer.step = ...`,
    `trainer.engine.step = ...`, `self.trainer.x = ...`) and every `setattr(...)` call."""
    found = []
    for node in ast.walk(ast.parse(text)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            chain = target
            while isinstance(chain, ast.Attribute):
                if isinstance(chain.value, ast.Name) and chain.value.id in ROOTS or chain.attr in ROOTS:
                    found.append(ast.unparse(node))
                    break
                chain = chain.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(ast.unparse(node))
    return found


def test_the_patch_finder_catches_assignments_to_the_trainer_and_engines():
    assert patches("trainer.step = 5\nself.trainer.engine.step = wrap\nsetattr(model, 'x', 1)\n") == [
        "trainer.step = 5", "self.trainer.engine.step = wrap", "setattr(model, 'x', 1)"]
    assert patches("if trainer.step == 3:\n    step = trainer.step\nx = 'trainer.step = 1'\nself.step = 2\n") == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_benchmark_or_tool_patches_the_trainer_engines_or_deepspeed(path):
    assert patches(path.read_text()) == [], path


def test_no_tool_imports_another_tool():
    tools = {p.stem for p in (ROOT / "tools").glob("*.py")}
    found = []
    for path in (ROOT / "tools").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(path.stem, n.split(".")[0]) for n in names if n.split(".")[0] in tools]
    assert found == []


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_has_a_quick_preset_of_its_own_keys_and_refuses_unknown_ones(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    (cls,) = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Settings) and v is not Settings]
    fields = {f.name for f in dataclasses.fields(cls)}
    assert cls.QUICK and set(cls.QUICK) <= fields, name
    assert parse(cls, ["--quick"], "")[0].quick is True
    with pytest.raises(SystemExit):
        parse(cls, ["no_such_key=1"], "")
    assert "unknown config key 'no_such_key'" in capsys.readouterr().err
