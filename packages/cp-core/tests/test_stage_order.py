"""cp_core's stages import one way: comm <- batch <- placement <- plan <- runtime.kernels <- runtime
<- front door.

The kernels (``runtime/kernels/``: the local attention maths and the one online-softmax
merge) are a stage of their own below the rest of the runtime: they import no transport, door
or plan binding, so a ring calling a kernel per step goes down a stage, not back to a file it left.

Every import counts, deferred ones inside functions included: a stage that reaches upward,
even lazily, is a stage that knows about its callers. ``cp_core.errors`` (the exception types)
and the one plugin loader ``cp_core.plugins`` are leaves every stage may import (a leaf imports
nothing of cp_core but the error types). The front door (registry, sharder, loss, hf, cli, testing,
...) may import any stage.
"""

from __future__ import annotations

import ast
from pathlib import Path

import cp_core
from cp_core.testing.imports import package_modules

SRC = Path(cp_core.__file__).resolve().parent
STAGES = ("comm", "batch", "placement", "plan", "runtime.kernels", "runtime")
LEAVES = {"cp_core.errors", "cp_core.plugins"}


def stage_of(module: str) -> int:
    """Index of ``module``'s stage in :data:`STAGES`; the front door is ``len(STAGES)``."""
    rest = module.split(".", 1)[1] if "." in module else ""
    # The longest stage prefix wins: runtime.kernels.fused is the kernels stage, not runtime.
    for i in sorted(range(len(STAGES)), key=lambda j: -len(STAGES[j])):
        if rest == STAGES[i] or rest.startswith(STAGES[i] + "."):
            return i
    return len(STAGES)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted target) of every absolute cp_core import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "cp_core":
                out += [(node.lineno, f"cp_core.{a.name}") for a in node.names]
            elif node.module.startswith("cp_core."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("cp_core.")]
    return out


def upward_imports(src: Path) -> list[str]:
    """Every import from a stage to a later stage or the front door, as ``file:line -> target``."""
    bad = []
    for name, path in package_modules(src).items():
        here = stage_of(name)
        for line, target in imported_modules(path):
            if target in LEAVES:
                continue
            if stage_of(target) > here:
                bad.append(f"{name}:{line} -> {target}")
    return bad


def test_stages_import_one_way() -> None:
    assert upward_imports(SRC) == []


def test_leaves_import_only_the_errors() -> None:
    mods = package_modules(SRC)
    for leaf in LEAVES:
        targets = {t for _, t in imported_modules(mods[leaf])}
        assert targets <= {"cp_core.errors"}, (leaf, targets)


def test_every_stage_is_a_folder() -> None:
    for stage in STAGES:
        assert (SRC / stage.replace(".", "/") / "__init__.py").is_file(), stage


def test_the_rule_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker has teeth: a placement module importing the runtime, even lazily, is found."""
    pkg = tmp_path / "cp_core"
    (pkg / "placement").mkdir(parents=True)
    (pkg / "runtime").mkdir()
    for d in (pkg, pkg / "placement", pkg / "runtime"):
        (d / "__init__.py").write_text("")
    (pkg / "runtime" / "door.py").write_text("from cp_core.placement import layout\n")
    (pkg / "placement" / "layout.py").write_text(
        "from cp_core.errors import CPError\n\ndef f():\n    from cp_core.runtime import door\n")
    assert upward_imports(pkg) == ["cp_core.placement.layout:4 -> cp_core.runtime"]


def test_the_rule_sees_a_kernel_importing_the_runtime(tmp_path: Path) -> None:
    """A kernel that reaches the door (or any runtime module outside the kernels) is found."""
    pkg = tmp_path / "cp_core"
    (pkg / "runtime" / "kernels").mkdir(parents=True)
    for d in (pkg, pkg / "runtime", pkg / "runtime" / "kernels"):
        (d / "__init__.py").write_text("")
    (pkg / "runtime" / "door.py").write_text("from cp_core.runtime.kernels import fused\n")
    (pkg / "runtime" / "kernels" / "fused.py").write_text(
        "def f():\n    from cp_core.runtime.door import call_transport\n")
    assert upward_imports(pkg) == ["cp_core.runtime.kernels.fused:2 -> cp_core.runtime.door"]
