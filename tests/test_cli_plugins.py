"""The CLI imports only the selected backend: a plugin nobody selected never runs its code.

A fake plugin distribution (a ``.dist-info`` with a ``cp_core.backends`` entry point on a
temporary ``sys.path`` entry) whose module raises ``SystemExit`` at import, and writes a marker
file first so a test can tell whether its import-time code ran at all.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cp_core.errors import CPBackendLoadError
from cp_core.registry import Registry

PLUGIN = "evil_cp_plugin"


def _install_fake_plugin(root: Path) -> Path:
    """Write the plugin into ``root`` (put on sys.path); returns the marker its import writes."""
    marker = root / "imported.marker"
    (root / f"{PLUGIN}.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('imported')\n"
        "raise SystemExit(3)\n")
    info = root / f"{PLUGIN}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[cp_core.backends]\nevil = {PLUGIN}:BACKEND\n")
    return marker


def _cp_plan(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    code = "import sys; from cp_core.cli.plan import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, f"hydra.run.dir={root / 'run'}", *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_unselected_plugin_that_exits_on_import_never_runs(tmp_path: Path) -> None:
    marker = _install_fake_plugin(tmp_path)
    res = _cp_plan(tmp_path, "cp=round_robin", "plan.docs=[3,5]")
    assert res.returncode == 0, res.stderr
    assert "max/mean: tokens" in res.stdout
    assert not marker.exists(), "the unselected plugin's import-time code ran"


def test_selected_plugin_that_exits_on_import_gives_one_line(tmp_path: Path) -> None:
    marker = _install_fake_plugin(tmp_path)
    res = _cp_plan(tmp_path, "cp=evil")
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("cp-plan: error: CP backend 'evil' (evil_cp_plugin:BACKEND)")
    assert "failed to import: SystemExit: 3" in lines[0]
    assert marker.exists()


def test_help_lists_unselected_plugins_by_name_without_importing(tmp_path: Path) -> None:
    marker = _install_fake_plugin(tmp_path)
    res = _cp_plan(tmp_path, "--help")
    assert res.returncode == 0, res.stderr
    assert "  evil         (not imported; cp=evil --help describes it)" in res.stdout
    assert not marker.exists()


def _evil_registry(root: Path) -> Registry:
    _install_fake_plugin(root)
    good = [ep for ep in md.entry_points(group="cp_core.backends") if ep.name == "contiguous"]
    evil = md.EntryPoint(name="evil", value=f"{PLUGIN}:BACKEND", group="cp_core.backends")
    return Registry([*good, evil])


def test_registry_contains_a_plugin_that_raises_system_exit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    registry = _evil_registry(tmp_path)
    with pytest.raises(CPBackendLoadError, match="'evil'.*SystemExit: 3") as info:
        registry.get("evil")
    assert isinstance(info.value.__cause__, SystemExit)
    loaded, errors = registry.load_all()
    assert list(loaded) == ["contiguous"] and list(errors) == ["evil"]


def test_hydra_registration_warns_about_an_exiting_plugin_and_keeps_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cp_core.hydra_config import register_backend_configs

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors = register_backend_configs(registry=_evil_registry(tmp_path))
    assert list(errors) == ["evil"]
    assert any("'evil' could not be registered" in str(w.message) for w in caught)
