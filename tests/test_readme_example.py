"""The README's training-step example runs as written (torchrun, 4 gloo ranks: dp 2 x cp 2)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_runs import readme_example, torchrun  # noqa: E402

pytestmark = pytest.mark.multirank


def test_readme_training_step_runs(tmp_path: Path) -> None:
    script = tmp_path / "train_step.py"
    script.write_text(readme_example("## A training step with a sharder"))
    proc = torchrun(script, 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    # Untrained on a 256-token vocabulary: each replica reports its share (half) of ~ln(256).
    assert all(2.0 < x < 3.5 for x in losses), losses
