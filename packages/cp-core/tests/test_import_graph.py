"""cp-core's modules form no import circle, and the library never imports its CLI.

The graph is read from the sources with ``ast``: an edge for every import a module runs when
it is imported (module level, ``if TYPE_CHECKING`` blocks excluded; imports inside functions
are deferred and do not count). ``from cp_core.x import y`` is an edge to ``cp_core.x.y`` when
that is a module, else to ``cp_core.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cp_core

SRC = Path(cp_core.__file__).resolve().parent
PKG = "cp_core"


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                todo.extend(handler.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the cp_core modules it imports at import time."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in _top_level_imports(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_library_does_not_import_the_cli() -> None:
    """Not even inside a function: the CLI sits on the library, never under it."""
    bad = []
    for name, path in _modules().items():
        if name.startswith(f"{PKG}.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            bad += [f"{name}:{node.lineno} -> {t}" for t in targets
                    if t == f"{PKG}.cli" or t.startswith(f"{PKG}.cli.")]
    assert not bad, bad


def test_no_core_module_imports_the_backend_api() -> None:
    """backend_api is the top of the graph: a core module importing it would make a circle
    waiting to happen (and blur what is declared for backends)."""
    graph = import_graph()
    assert not [m for m, ts in graph.items() if f"{PKG}.backend_api" in ts]
