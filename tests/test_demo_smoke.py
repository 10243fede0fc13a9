"""The README's main job runs end to end as a Hydra app: a multirun over two backends (each
job starts 2 gloo ranks with torch's elastic launcher), and the same app under torchrun."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tools" / "demo.py"


def _run(*args: str, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, text=True, capture_output=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _check_steps(out: str, n: int) -> None:
    steps = re.findall(r"cp loss (\S+)\s+cp=1 loss (\S+)\s+diff (\S+)", out)
    assert len(steps) == n, out
    for cp_loss, ref_loss, diff in steps:
        assert abs(float(cp_loss) - float(ref_loss)) <= 1e-5 * float(ref_loss)
        assert abs(float(diff)) <= 1e-5 * float(ref_loss)


@pytest.mark.multirank
def test_demo_multirun_two_backends_two_ranks(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = _run(str(DEMO), "-m", "cp=round_robin,magi", "cp.size=2", "demo.steps=2",
                "demo.seq_len=256", f"hydra.sweep.dir={sweep}")
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed:\n{out}\n{proc.stderr[-4000:]}"
    _check_steps(out, 4)
    assert out.count("verify_layout=True") == 2
    # One report row per rank: rank, tokens, pad, work, share, step ms.
    rows = re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)\s+([\d,]+)\s+([\d.]+)%", out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 0, 1]
    assert sum(int(r[1]) for r in rows[:2]) == 256  # 256 tokens, no layout pad at cp=2
    assert out.count("matches the CP=1 loss") == 2
    for job, backend in [("0", "round_robin"), ("1", "magi")]:
        saved = json.loads((sweep / job / "cp_demo.json").read_text())
        assert saved["backend"] == backend and saved["cp_size"] == 2 and len(saved["losses"]) == 2
        assert "matches the CP=1 loss" in (sweep / job / "cp_demo.log").read_text()
    # The sweep ends with one table of both jobs, saved in the sweep directory.
    table = (sweep / "comparison.txt").read_text()
    assert out.count("cp-demo comparison") == 1 and "cp-demo comparison" in table
    assert [ln.split()[:2] for ln in table.strip().splitlines()[3:]] == [["round_robin", "2"],
                                                                        ["magi", "2"]]


@pytest.mark.multirank
def test_demo_under_torchrun_takes_cp_size_from_the_world(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run("-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                str(DEMO), "cp=contiguous", "demo.steps=1", "demo.seq_len=128",
                f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _check_steps(proc.stdout, 1)
    assert "backend 'contiguous', cp.size=2" in proc.stdout

