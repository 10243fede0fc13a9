"""What a published package carries, checked on the manifests (fast; the wheels themselves are
built and installed by the slow tests in test_packaging.py)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
with open(REPO / "pyproject.toml", "rb") as _f:
    MEMBERS = [REPO / m for m in tomllib.load(_f)["tool"]["cp-workspace"]["members"]]


def _project(folder: Path) -> dict:
    with open(folder / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _version(folder: Path) -> str:
    """The package's one version: static in pyproject, or ``__version__`` it points at."""
    data = _project(folder)
    if "version" in data["project"]:
        assert "version" not in data["project"].get("dynamic", [])
        return str(data["project"]["version"])
    attr = data["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module = attr.rsplit(".", 1)[0]
    init = folder / "src" / module.replace(".", "/") / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__version__":
            return str(ast.literal_eval(node.value))
    raise AssertionError(f"no __version__ in {init}")


@pytest.mark.parametrize("folder", MEMBERS, ids=[m.name for m in MEMBERS])
def test_package_carries_license_types_and_one_version(folder: Path) -> None:
    project = _project(folder)["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (folder / "LICENSE").read_text() == (REPO / "LICENSE").read_text()
    assert "Typing :: Typed" in project["classifiers"]
    module = project["name"].replace("-", "_")
    assert (folder / "src" / module / "py.typed").is_file()
    assert _version(folder) == _version(MEMBERS[0])  # versioned together
    init = (folder / "src" / module / "__init__.py").read_text()
    # A __version__ in the code is the source the manifest reads, never a second copy.
    if "__version__" in init:
        assert "version" not in project


def test_changelog_names_the_current_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(_version(MEMBERS[0]))}\b", text, re.M)


def test_shipped_configs_are_package_data() -> None:
    data = _project(REPO / "packages" / "cp-core")
    assert "conf/*.yaml" in data["tool"]["setuptools"]["package-data"]["cp_core"]
    assert "hydra_plugins*" in data["tool"]["setuptools"]["packages"]["find"]["include"]
