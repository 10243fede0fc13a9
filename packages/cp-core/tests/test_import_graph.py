"""cp-core's modules form no import circle, and the library never imports its CLI.

The graph is read from the sources (:mod:`cp_core.testing.imports`), so every module is
covered whether or not a test imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cp_core
from cp_core.testing.imports import find_cycle, import_graph, package_modules

SRC = Path(cp_core.__file__).resolve().parent
PKG = "cp_core"


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph(SRC))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_module_level_imports_only(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\nimport typing\nif typing.TYPE_CHECKING:\n"
                              "    import pkg.c\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from pkg.a import x\n")
    assert import_graph(pkg) == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": set(),
                                 "pkg.c": {"pkg.a"}}


def test_the_library_does_not_import_the_cli() -> None:
    """Not even inside a function: the CLI sits on the library, never under it."""
    bad = []
    for name, path in package_modules(SRC).items():
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
    graph = import_graph(SRC)
    assert not [m for m, ts in graph.items() if f"{PKG}.backend_api" in ts]
