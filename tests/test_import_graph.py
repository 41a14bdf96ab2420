"""No import circle inside distsparse (issue 29 item 5): every module under distsparse/ is parsed with `ast`, and
its imports of other distsparse modules, at the top and inside functions alike, make a graph with no cycle.

A circle only works while every module on it avoids touching a name the others have not defined yet, which is why
the last one had hidden an import inside a function; that import counts here too. Imports under
`if TYPE_CHECKING:` never run and are left out.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "distsparse"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(nodes):
    """Every Import / ImportFrom node under `nodes`, at any depth, but in `if TYPE_CHECKING:` bodies."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking_only(node):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def imported_modules(name: str, is_package: bool, tree: ast.AST, modules: set[str]) -> set[str]:
    """The package modules that importing `name` runs, directly: each import's target and the `__init__` of each
    package on the way to it (a module's own enclosing packages are already running and are left out)."""
    targets = set()
    for node in _imports([tree]):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        if node.level:   # relative: from the module's own package, one level up per extra dot
            base = name.split(".") if is_package else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        targets.add(source)
        # `from pkg import sub` imports the submodule pkg.sub when there is one; otherwise it is a name in pkg
        targets.update(f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules)
    enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1 + is_package)}
    out = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix not in enclosing and prefix != name:
                out.add(prefix)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    return {name: imported_modules(name, path.name == "__init__.py", ast.parse(path.read_text(), str(path)),
                                   set(files))
            for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as [a, b, ..., a], or None (depth-first search, sorted for a stable answer)."""
    state: dict[str, int] = {}   # 1: on the current path, 2: finished

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_find_cycle_names_a_circle_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_reads_function_level_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.leaf import X\n")
    (pkg / "sub" / "leaf.py").write_text("from typing import TYPE_CHECKING\nX = 1\n"
                                         "if TYPE_CHECKING:\n    from pkg.top import Y\n")
    (pkg / "top.py").write_text("def f():\n    from .sub import X\n")
    (pkg / "other.py").write_text("import pkg.sub.leaf\nfrom pkg import top\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.top"] == {"pkg.sub"}                        # inside a function, relative
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}                   # its own package is not an edge
    assert graph["pkg.sub.leaf"] == set()                         # TYPE_CHECKING only
    assert graph["pkg.other"] == {"pkg.sub", "pkg.sub.leaf", "pkg.top"}   # the package __init__ on the way runs
    (pkg / "sub" / "leaf.py").write_text("from pkg.top import f\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.sub", "pkg.sub.leaf", "pkg.top", "pkg.sub"]


def test_distsparse_has_no_import_circle():
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 50 and graph["distsparse.models.build"]   # the walk saw the package
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {' -> '.join(cycle)}"
