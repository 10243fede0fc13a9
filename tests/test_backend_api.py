"""Backends use cp-core only through its declared interface.

Every backend package (ours and the plugin example) may import from cp-core the names of
:mod:`cp_core.backend_api` and the public top-level names of :mod:`cp_core`
(``cp_core.__all__``), nothing else (docs/plugins.md). The sources are parsed, not imported,
so a backend whose optional GPU dependency is missing is checked too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import cp_core
import cp_core.backend_api as backend_api
from cp_core.testing.imports import find_cycle, import_graph

ROOT = Path(__file__).resolve().parents[1]
BACKEND_SOURCES = ("packages/cp-te/src", "packages/cp-magi/src", "packages/cp-blockdiag/src",
                   "examples/cp-plugin-example/src")
API = "cp_core.backend_api"


def _violations(path: Path) -> list[str]:
    """``file:line: import`` for every cp-core import of ``path`` outside the declared API."""
    bad = []
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cp_core" and alias.name != API:
                    bad.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "cp_core":
            names = [a.name for a in node.names]
            if node.module == API:
                allowed = set(backend_api.__all__)
            elif node.module == "cp_core":
                allowed = set(cp_core.__all__) | {"backend_api"}
            else:
                allowed = set()
            for name in names:
                if name not in allowed:
                    bad.append(f"{path}:{node.lineno}: from {node.module} import {name}")
    return bad


def _sources() -> list[Path]:
    return sorted(p for src in BACKEND_SOURCES for p in (ROOT / src).rglob("*.py"))


def test_every_backend_source_is_checked() -> None:
    found = {str(p.relative_to(ROOT)).split("/src/")[0] for p in _sources()}
    assert found == {s.removesuffix("/src") for s in BACKEND_SOURCES}


def test_backends_import_only_the_declared_api() -> None:
    bad = [v for p in _sources() for v in _violations(p)]
    assert not bad, (
        "backend packages must import cp-core only through cp_core.backend_api (or the public "
        "top-level cp_core names); add the name to cp_core.backend_api if backends really "
        "need it:\n" + "\n".join(bad))


def test_the_check_catches_an_undeclared_import(tmp_path: Path) -> None:
    src = tmp_path / "mod.py"
    src.write_text("from cp_core.builtin import make_plan\nimport cp_core.comm.collectives\n"
                   "from cp_core.backend_api import make_plan, no_such_name\n"
                   "from cp_core import ShardLayout, comm\n")
    bad = _violations(src)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "from cp_core.builtin import make_plan", "import cp_core.comm.collectives",
        "from cp_core.backend_api import no_such_name", "from cp_core import comm"]


@pytest.mark.parametrize("src", BACKEND_SOURCES)
def test_no_backend_has_an_import_circle(src: str) -> None:
    for package in sorted(p for p in (ROOT / src).iterdir() if (p / "__init__.py").exists()):
        cycle = find_cycle(import_graph(package))
        assert cycle is None, f"{src}: import circle " + " -> ".join(cycle or [])


def test_a_backends_runtime_never_imports_pytest_or_the_cli() -> None:
    """The conformance suite is served lazily: importing the API (and every backend) at
    training time pulls in neither pytest nor cp-core's command-line apps."""
    code = ("import sys, cp_core.backend_api, cp_te, cp_magi, cp_blockdiag; "
            "bad = [m for m in ('pytest', 'cp_core.cli', 'cp_core.testing.conformance') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)


@pytest.mark.parametrize("name", backend_api.__all__)
def test_every_declared_name_resolves(name: str) -> None:
    assert getattr(backend_api, name) is not None
