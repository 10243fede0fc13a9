"""Packaging: wheels of every package, the ``cp-core[...]`` extras, and each package alone.

Everything is installed offline from freshly built wheels into new virtual environments (see
``conftest.py``: third-party dependencies come from a shim of the project's environment, so
nothing large is downloaded and none of the editable ``cp-*`` installs is visible).

Each package alone: every file of it installed with the workspace's bytes, every module
importing, and its tests that an install can break run against the installed wheel.
"""

from __future__ import annotations

import json
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
FreshEnv = Any  # conftest.FreshEnv (conftest modules are not importable under importlib mode)


def _toml(path: Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def project_name(folder: Path) -> str:
    """The distribution name declared in ``folder/pyproject.toml``."""
    return str(_toml(folder / "pyproject.toml")["project"]["name"])


#: Package folders listed in the root pyproject.toml (the workspace members).
MEMBERS = [REPO / m for m in _toml(REPO / "pyproject.toml")["tool"]["cp-workspace"]["members"]]

#: The backend each extra brings and the distribution that provides it.
EXTRAS = {"te": ("cp-te", "te_thd"), "magi": ("cp-magi", "magi"),
          "blockdiag": ("cp-blockdiag", "blockdiag")}

_PROBE = """
import json
from cp_core.registry import available_backends, get_backend
out = {"available": list(available_backends()), "errors": {}}
for name in NAMES:
    try:
        get_backend(name)
    except Exception as exc:
        out["errors"][name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _probe(env: FreshEnv, names: list[str]) -> dict:
    proc = env.run("python", "-c", _PROBE.replace("NAMES", repr(names)))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_package_has_a_wheel_with_its_entry_points(wheelhouse: Path) -> None:
    wheels = {p.name.split("-")[0]: p for p in wheelhouse.glob("*.whl")}
    for folder in MEMBERS:
        dist = project_name(folder).replace("-", "_")
        assert dist in wheels, f"no wheel for {folder.name}; built {sorted(wheels)}"
    with zipfile.ZipFile(wheels["cp_core"]) as zf:
        names = zf.namelist()
        eps = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    # Package data a user needs at run time travels in the wheel.
    assert "cp_core/data/doc_length_distribution.csv" in names
    for backend in ("identity", "contiguous", "round_robin", "aux_only"):
        assert f"{backend} = cp_core.backends:" in eps
    assert "cp-plan = cp_core.cli.plan:main" in eps
    # The Hydra configs and the search-path plugin travel in the wheel (same app everywhere).
    assert {"cp_core/conf/cp_plan.yaml", "cp_core/conf/cp_demo.yaml",
            "hydra_plugins/cp_core_searchpath/__init__.py", "cp_core/py.typed"} <= set(names)
    for folder in MEMBERS:
        with zipfile.ZipFile(wheels[project_name(folder).replace("-", "_")]) as zf:
            assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist()), folder


@pytest.fixture(scope="module")
def resolve_env(tmp_path_factory: pytest.TempPathFactory, fresh_env_factory: Any) -> FreshEnv:
    """An empty environment for ``pip install --dry-run``: a dry run installs nothing, so
    every extra resolves against the same empty environment."""
    return fresh_env_factory(tmp_path_factory.mktemp("resolve") / "venv")


@pytest.fixture(scope="module")
def te_env(tmp_path_factory: pytest.TempPathFactory, fresh_env_factory: Any) -> FreshEnv:
    """``cp-te`` installed alone (which brings ``cp-core``), then ``cp-core[te]`` (nothing
    left to add): the one environment both hold, shared by the te tests below."""
    env = fresh_env_factory(tmp_path_factory.mktemp("te") / "venv")
    env.pip_install("cp-te")
    env.pip_install("cp-core[te]")
    return env


def _installed_cp(env: FreshEnv) -> set[str]:
    """The ``cp-*`` distributions installed in ``env``."""
    code = ("import importlib.metadata as md; "
            "print(sorted({d.metadata['Name'] for d in md.distributions()}))")
    names = eval(env.run("python", "-c", code).stdout.strip().splitlines()[-1])
    return {n for n in names if n.startswith("cp-")}


@pytest.mark.parametrize("extra", ["te", "magi", "blockdiag", "all"])
def test_extra_resolves_to_its_backend_packages(resolve_env: FreshEnv, extra: str) -> None:
    report = resolve_env.root / f"report-{extra}.json"
    resolve_env.pip_install("--dry-run", "--report", str(report),
                            f"cp-core[{extra}]")
    assert _installed_cp(resolve_env) == set(), "a dry run installed something"
    names = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    wanted = {dist for dist, _ in EXTRAS.values()} if extra == "all" else {EXTRAS[extra][0]}
    assert {n for n in names if n.startswith("cp-")} == {"cp-core", *wanted}


def test_te_extra_in_a_fresh_environment(te_env: FreshEnv) -> None:
    fresh_env = te_env
    assert _installed_cp(fresh_env) == {"cp-core", "cp-te"}
    out = _probe(fresh_env, ["te_thd", "magi"])
    assert "te_thd" in out["available"] and "magi" not in out["available"]
    assert {"identity", "contiguous", "round_robin", "aux_only"} <= set(out["available"])
    assert "te_thd" not in out["errors"], out["errors"].get("te_thd")
    assert "pip install 'cp-core[magi]'" in out["errors"]["magi"]
    assert out["errors"]["magi"].startswith("CPBackendNotFoundError")
    # The wheel's apps behave as the checkout's: the same defaults and keys from any folder,
    # and the uninstalled backend named with its install line in one line, exit code 2.
    plan = fresh_env.run("cp-plan", "plan.docs=[3,5]", "hydra.run.dir=run").stdout
    assert "backend=round_robin cp.size=2" in plan
    job = fresh_env.run("cp-demo", "cp=te_thd", "demo.steps=3", "--cfg", "job").stdout
    assert "backend: te_thd" in job and "steps: 3" in job
    import subprocess

    proc = subprocess.run([fresh_env.script("cp-plan"), "cp=magi"], cwd=fresh_env.root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "pip install 'cp-core[magi]'" in proc.stderr


@pytest.mark.parametrize("folder", MEMBERS, ids=[m.name for m in MEMBERS])
def test_package_installs_alone_and_matches_the_workspace(request: pytest.FixtureRequest,
                                                    folder: Path) -> None:
    dist = project_name(folder)
    if dist == "cp-te":  # te_env installed cp-te alone first; cp-core[te] added nothing
        fresh_env = request.getfixturevalue("te_env")
    else:
        fresh_env = request.getfixturevalue("fresh_env")
        fresh_env.pip_install(dist)
    assert _installed_cp(fresh_env) == {"cp-core", dist}
    # The installed package is the workspace's code, file for file: every source and data
    # file of the package is installed with the same bytes, and every module imports there.
    # The workspace run tests that code in full; here only what an install can break is left
    # to catch (a missing file, a package-data rule, an entry point, a path computed from the
    # source tree), so a few of the package's tests run against the wheel, not all of them.
    # One interpreter answers where cp_core comes from, which backends are available and the
    # file check (each interpreter start imports torch: seconds on a loaded 2-core host).
    report = _check_installed_files(fresh_env, folder)
    where = report["cp_core_file"]
    assert str(fresh_env.root) in where, f"cp_core imported from outside the fresh env: {where}"
    others = {d for d, _ in EXTRAS.values()} - {dist}
    provided = {b for d, b in EXTRAS.values() if d in others}
    assert not provided & set(report["available"]), "another backend package leaked in"
    tests = [str(folder / "tests" / t) for t in INSTALLED_TESTS[dist]]
    fresh_env.run("python", "-m", "pytest", *tests, "-q", "-x", "-m", "not multirank",
                  "-k", INSTALLED_SKIP, "-p", "no:cacheprovider", cwd=fresh_env.root,
                  timeout=600)


#: The tests each package runs against its installed wheel: those that read package data,
#: walk the registry and entry points, or check the public surface and the backend contract
#: (the rest run in the workspace against the same files, checked byte for byte above).
INSTALLED_TESTS = {
    "cp-core": ["test_conformance_framework.py", "test_registry.py", "test_public_surface.py",
                "test_datasets.py"],
    "cp-te": ["test_conformance.py", "test_config.py"],
    "cp-magi": ["test_locality_conformance.py", "test_solver_tolerance.py"],
    "cp-blockdiag": ["test_batch.py", "test_runtime_route.py"],
}
#: Left out of the installed runs (the workspace runs them on the same bytes): the contract's
#: largest CP size and the position-only model's bitwise gather, which exercise the layout
#: (not the install) and build the largest fixtures.
INSTALLED_SKIP = "not position_only and not cp8"

_FILES = """
import hashlib, importlib, json, pathlib, sys
out, failed = {}, {}
for rel, mod in json.loads(sys.argv[1]):
    top = pathlib.Path(importlib.import_module(rel.split("/")[0]).__path__[0]).parent
    path = top / rel
    out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    if not mod:
        continue
    try:
        importlib.import_module(mod)
    except ImportError as exc:
        # An optional extra that is not installed (trl, transformers, ...) may be missing,
        # with the library's own install hint; a module of the project itself may not.
        missing = getattr(exc, "name", None) or ""
        optional = ("pip install" in str(exc) or (isinstance(exc, ModuleNotFoundError)
                    and not missing.startswith(("cp_", "hydra_plugins"))))
        if not optional:
            failed[mod] = f"{type(exc).__name__}: {exc}"
import cp_core
from cp_core.registry import available_backends
print(json.dumps({"files": out, "failed": failed, "cp_core_file": cp_core.__file__,
                  "available": list(available_backends())}))
"""


def _check_installed_files(env: FreshEnv, folder: Path) -> dict:
    """Every file under ``folder/src`` (sources, data, configs, markers) is installed in
    ``env`` with the same bytes, and every module of it imports there (or, for a module that
    needs an optional extra, fails only for want of that extra). Returns the probe's report,
    which also holds ``cp_core_file`` and the ``available`` backends of that interpreter."""
    import hashlib

    src = folder / "src"
    files = sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and not any(part.endswith(".egg-info") for part in p.parts))
    wanted = []
    for p in files:
        rel = p.relative_to(src).as_posix()
        mod = None
        if p.suffix == ".py":
            mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        wanted.append((rel, mod))
    assert wanted, f"no source files under {src}"
    proc = env.run("python", "-c", _FILES, json.dumps(wanted))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["failed"], f"modules of {folder.name} fail to import: {report['failed']}"
    got = report["files"]
    for p, (rel, _) in zip(files, wanted):
        assert got[rel] is not None, f"{rel} of {folder.name} is not installed"
        assert got[rel] == hashlib.sha256(p.read_bytes()).hexdigest(), (
            f"{rel} of {folder.name} differs from the workspace's")
    return report
