"""The README's main job runs end to end: torchrun, 2 gloo ranks, CP loss next to CP=1."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tools" / "demo.py"


def _run(*overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), *overrides], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.multirank
def test_demo_two_ranks_two_steps_matches_cp1() -> None:
    proc = _run("cp=round_robin", "cp.size=2", "demo.steps=2", "demo.seq_len=256")
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr[-4000:]}"
    steps = re.findall(r"cp loss (\S+)\s+cp=1 loss (\S+)\s+diff (\S+)", out)
    assert len(steps) == 2, out
    for cp_loss, ref_loss, diff in steps:
        assert abs(float(cp_loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
        assert abs(float(diff)) <= 1e-5 * float(ref_loss)
    assert "verify_layout=True" in out
    # One report row per rank: rank, tokens, pad, work, share, step ms.
    rows = re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)\s+([\d,]+)\s+([\d.]+)%", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1]
    assert sum(int(r[1]) for r in rows) == 256  # 256 tokens, no layout pad at cp=2
    assert "matches the CP=1 loss" in out


def test_demo_rejects_a_bad_override_before_launching() -> None:
    proc = _run("+cp.bogus=1", timeout=120)
    assert proc.returncode == 2
    assert "unknown key cp.bogus" in proc.stderr
    assert "torch.distributed" not in proc.stderr
