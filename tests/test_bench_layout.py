"""The benchmarks' layout (issue 29): the loop is measured from inside, not patched; no user tool imports another
tool; every benchmark in bench/ takes the harness's settings (a quick preset and strict key=value overrides); the
README's and docs' bench commands name modules, settings and options that exist, and their tools/ files exist."""

import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
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


def _settings_class(module) -> type:
    (cls,) = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Settings) and v is not Settings]
    return cls


def _documented_commands() -> list[tuple[str, str, list[str]]]:
    """(file, module, arguments) of every `python -m bench.<module> ...` in README.md and docs/*.md, the arguments
    up to the end of the code span or line (a trailing backslash continues it)."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text().replace("\\\n", " ")
        for m in re.finditer(r"python -m bench\.(\w+)([^`\n]*)", text):
            found.append((doc.name, m.group(1), m.group(2).split()))
    return found


def test_every_documented_bench_command_names_a_module_and_settings_or_options_it_takes():
    """A cluster user copies these: the module exists, each key=value is a field of its settings, each --option is
    one its parser knows (harness benchmarks: --quick and --json; the quality tools: their argparse options)."""
    commands = _documented_commands()
    assert len(commands) >= 15
    wrong = []
    for doc, name, args in commands:
        if importlib.util.find_spec(f"bench.{name}") is None:
            wrong.append((doc, name, "no such module"))
            continue
        module = importlib.import_module(f"bench.{name}")
        if name in BENCHMARKS:
            keys, options = {f.name for f in dataclasses.fields(_settings_class(module))}, {"--quick", "--json"}
        else:   # the options its --help lists (bench_quality's --plan mode: its own)
            keys, options = set(), set()
            for argv in (["--help"], ["--plan", "paper_60m", "--help"]):
                with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
                    module.main(argv)
                options |= set(re.findall(r"--[\w-]+", out.getvalue()))
        for arg in (a.strip("[]") for a in args):   # [--quick]: optional in a synopsis
            if re.fullmatch(r"\w+=\S*", arg) and arg.split("=")[0] not in keys:
                wrong.append((doc, name, arg))
            elif arg.startswith("--") and arg not in options | {"--help"}:
                wrong.append((doc, name, arg))
    assert wrong == []


def test_every_documented_tool_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {m for doc in docs for m in re.findall(r"\btools/(\w+\.(?:py|sh))", doc.read_text())}
    assert named and [n for n in sorted(named) if not (ROOT / "tools" / n).is_file()] == []
