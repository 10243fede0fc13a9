"""The README's training-step example runs as written (torchrun, 4 gloo ranks: dp 2 x cp 2)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multirank


def _example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## A training step with a sharder", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README lost its training-step example"
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_readme_training_step_runs(tmp_path: Path) -> None:
    script = tmp_path / "train_step.py"
    script.write_text(_example())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}", str(script)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    # Untrained on a 256-token vocabulary: each replica reports its share (half) of ~ln(256).
    assert all(2.0 < x < 3.5 for x in losses), losses
