"""``examples/hf-trainer/sft.py`` runs as its docstring says: torchrun, 4 CPU ranks, dp 2 x cp 2.

Exactness is shown by ``test_hf_trainer_multirank.py``; this checks the user-facing script
launches, trains its 5 steps under both backends it names and reports finite losses.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_runs import REPO, torchrun  # noqa: E402

pytest.importorskip("trl")
pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SCRIPT = REPO / "examples" / "hf-trainer" / "sft.py"


@pytest.mark.parametrize("backend,cp", [("round_robin", "2"), ("te_thd", "4")])
def test_example_sft_script_trains(backend: str, cp: str) -> None:
    proc = torchrun(SCRIPT, 4, backend, cp, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"backend (\S+), dp (\d) x cp (\d): losses \[(.*)\]", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert match.group(1) == backend and int(match.group(2)) * int(match.group(3)) == 4
    losses = [float(x) for x in match.group(4).split(",")]
    assert len(losses) == 5 and all(math.isfinite(x) and 0 < x < 10 for x in losses), losses
