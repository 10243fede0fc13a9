"""Fixtures of the cross-package tests: wheels of every package and fresh virtual environments.

The packaging and plugin tests install the workspace's wheels into brand-new virtual
environments, the way a user would. Torch (and the other third-party dependencies) are not
downloaded again: a "shim" folder of symbolic links to exactly those distributions in the
project's environment is put on the fresh environment's path with a ``.pth`` file. Nothing
else of the project environment leaks in — in particular none of the editable ``cp-*``
installs or their entry points — so what the fresh environment can import and discover comes
from the wheels alone. Installs run offline (``--no-index --find-links <wheels>``).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from hypothesis import settings as hypothesis_settings

# CI replays the same examples every run (a failure there is reproducible and never a fluke of
# the draw); a developer's run explores new ones.
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI") == "true":
    hypothesis_settings.load_profile("ci")

REPO = Path(__file__).resolve().parents[1]
PLUGIN_EXAMPLE = REPO / "examples" / "cp-plugin-example"

#: Third-party distributions the packages and their tests import; their dependency closure
#: is linked into the shim.
SHIM_ROOTS = ("torch", "numpy", "pydantic", "hydra-core", "pytest", "hypothesis", "matplotlib",
              "transformers")

#: Files that must not be copied into a build (stale build output, caches).
_BUILD_IGNORE = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def workspace_members() -> list[Path]:
    """Package folders listed in the root ``pyproject.toml``."""
    with open(REPO / "pyproject.toml", "rb") as f:
        members = tomllib.load(f)["tool"]["cp-workspace"]["members"]
    return [REPO / m for m in members]


def project_name(folder: Path) -> str:
    """The distribution name declared in ``folder/pyproject.toml``."""
    with open(folder / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["name"])


def _clean_env() -> dict[str, str]:
    """Environment of subprocesses: nothing that points back at the project's environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "CP_CONFIG_DIR")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(cmd: list[str], *, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` and fail the test with its output when it exits non-zero."""
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                    f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def dependency_closure(roots: Iterable[str]) -> list[md.Distribution]:
    """Installed distributions needed by ``roots`` (their non-extra requirements, recursively)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name.startswith("cp-"):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional platform dependency that is not installed here
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def build_shim(dest: Path, roots: Iterable[str] = SHIM_ROOTS) -> Path:
    """A folder of symbolic links to the top-level files of ``roots``' dependency closure."""
    dest.mkdir(parents=True, exist_ok=True)
    for dist in dependency_closure(roots):
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "")}
        for top in tops:
            src = Path(str(dist.locate_file(top)))
            link = dest / top
            if src.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(src)
    return dest


@dataclass
class FreshEnv:
    """A new virtual environment whose third-party packages come from the shim."""

    root: Path
    wheels: Path

    @property
    def python(self) -> str:
        """Its interpreter."""
        return str(self.root / "bin" / "python")

    def script(self, name: str) -> str:
        """Path of an installed console script."""
        return str(self.root / "bin" / name)

    def pip_install(self, *requirements: str) -> str:
        """Install from the wheel folder only (offline) with the project's pip; its output."""
        cmd = [sys.executable, "-m", "pip", "--python", self.python, "install", "-q",
               "--no-index", "--find-links", str(self.wheels), *requirements]
        return run(cmd, cwd=self.root).stdout

    def run(self, *args: str, cwd: Path | None = None, timeout: float = 300
            ) -> subprocess.CompletedProcess:
        """Run a command (``args[0]`` a script name of this env or ``python``)."""
        exe = self.python if args[0] == "python" else self.script(args[0])
        return run([exe, *args[1:]], cwd=cwd or self.root, timeout=timeout)


def make_fresh_env(path: Path, wheels: Path, shim: Path) -> FreshEnv:
    """Create a venv at ``path`` (no pip of its own) that sees the shim's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   env=_clean_env())
    env = FreshEnv(path, wheels)
    purelib = subprocess.run(
        [env.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=_clean_env(),
    ).stdout.strip()
    Path(purelib, "cp_test_shim.pth").write_text(str(shim) + "\n")
    return env


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wheels of every workspace package and of the plugin example, built once per session
    from clean copies of their folders (so stale build output never reaches a wheel)."""
    root = tmp_path_factory.mktemp("wheelhouse")
    src_root, out = root / "src", root / "wheels"
    copies = []
    for folder in [*workspace_members(), PLUGIN_EXAMPLE]:
        dest = src_root / folder.name
        shutil.copytree(folder, dest, ignore=_BUILD_IGNORE)
        copies.append(str(dest))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(out), *copies], cwd=root)
    return out


@pytest.fixture(scope="session")
def torch_shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shim folder (third-party dependencies of the project environment, linked)."""
    return build_shim(tmp_path_factory.mktemp("shim") / "site")


@pytest.fixture(scope="session")
def fresh_env_factory(wheelhouse: Path, torch_shim: Path) -> Callable[[Path], FreshEnv]:
    """``make(path)``: a new virtual environment at ``path`` (for module-scoped fixtures)."""
    return lambda path: make_fresh_env(path, wheelhouse, torch_shim)


@pytest.fixture
def fresh_env(tmp_path: Path, wheelhouse: Path, torch_shim: Path) -> Iterator[FreshEnv]:
    """A new, empty virtual environment for one test."""
    yield make_fresh_env(tmp_path / "venv", wheelhouse, torch_shim)


__all__ = ["REPO", "PLUGIN_EXAMPLE", "FreshEnv", "make_fresh_env", "workspace_members",
           "project_name", "run", "dependency_closure", "build_shim"]
