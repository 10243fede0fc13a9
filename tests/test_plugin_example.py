"""The third-party plugin example: installed into a fresh environment, selected as ``cp=striped``.

``examples/cp-plugin-example`` is built into a wheel and installed next to cp-core's wheel in
a new virtual environment. cp-core has never heard of it: no line of cp-core names it, and yet
``cp-plan cp=striped ...`` works there, its own Hydra config node included, and its own tests
(the cp-core conformance suite) pass against the installed packages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "examples" / "cp-plugin-example"
NAMES = ("striped", "cp_plugin_example", "cp-plugin-example")


def _rank_rows(text: str) -> dict[int, tuple[int, int, int]]:
    """``rank -> (tokens, pad, work)`` parsed from cp-plan's per-rank table."""
    rows = {}
    for m in re.finditer(r"^\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+[\d.]+%\s+[\d,]+$", text, re.M):
        rows[int(m.group(1))] = tuple(int(g.replace(",", "")) for g in m.groups()[1:])
    return rows


def test_no_line_of_cp_core_names_the_plugin() -> None:
    core = REPO / "packages" / "cp-core"
    hits = []
    for path in core.rglob("*"):
        if not path.is_file() or "__pycache__" in path.parts or any(
                p.endswith(".egg-info") for p in path.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(n in line.lower() for n in NAMES):
                hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not hits, "cp-core names the plugin:\n" + "\n".join(hits)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory, fresh_env_factory: Any) -> Any:
    """cp-core and the plugin, installed from their wheels into one new environment."""
    env = fresh_env_factory(tmp_path_factory.mktemp("plugin") / "venv")
    env.pip_install("cp-core", "cp-plugin-example")
    return env


def test_selected_by_name_outside_the_repository(plugin_env: Any, tmp_path: Path) -> None:
    # From a folder outside the repository the installed wheel's fallback config is used: the
    # plugin's node comes from its entry point alone.
    out = plugin_env.run("cp-plan", "cp=striped", "cp.size=4", "plan.docs=[5,3]",
                         "--plot", str(tmp_path / "striped.png"), cwd=tmp_path).stdout
    assert "backend=striped cp.size=4" in out
    # Token i on rank i mod 4; documents [5, 3] are causal: query j of a document sees j+1
    # keys, so rank r does (r+1 at r in doc 1) + (its doc-2 token):
    # rank 0: pos 0 (1) + pos 4 (5) = 6; rank 1: pos 1 (2) + pos 5 (1) = 3;
    # rank 2: pos 2 (3) + pos 6 (2) = 5; rank 3: pos 3 (4) + pos 7 (3) = 7.
    assert _rank_rows(out) == {0: (2, 0, 6), 1: (2, 0, 3), 2: (2, 0, 5), 3: (2, 0, 7)}
    assert (tmp_path / "striped.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_its_hydra_node_and_overrides_inside_the_repository(plugin_env: Any,
                                                            tmp_path: Path) -> None:
    # Inside the repository too (the configs ship in cp-core); the plugin's node is added to the
    # `cp` group at start-up (size 2 from its hydra_defaults), and its own key overrides.
    out = plugin_env.run("cp-plan", "cp=striped", "cp.stripe=2", "plan.docs=[5,3]",
                         f"hydra.run.dir={tmp_path / 'run'}", cwd=REPO).stdout
    assert "backend=striped cp.size=2" in out
    # Stripes of 2 at cp=2: rank 0 holds 0,1,4,5 (1+2+5+1), rank 1 holds 2,3,6,7 (3+4+2+3).
    assert _rank_rows(out) == {0: (4, 0, 9), 1: (4, 0, 12)}


def test_bad_plugin_key_is_a_clear_error(plugin_env: Any, tmp_path: Path) -> None:
    import subprocess

    proc = subprocess.run([plugin_env.script("cp-plan"), "cp=striped", "+cp.strip=2",
                           "plan.docs=[5,3]"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    assert "unknown key cp.strip" in proc.stderr + proc.stdout
    assert "stripe" in proc.stderr + proc.stdout


def test_its_own_tests_pass_against_the_installed_packages(plugin_env: Any) -> None:
    plugin_env.run("python", "-m", "pytest", str(PLUGIN / "tests"), "-q", "-x",
                   "-p", "no:cacheprovider", cwd=plugin_env.root, timeout=600)
