"""The default process group is freed by ``destroy_process_group()`` in a process that
imported cp_core first, even after an optimizer made torch import ``torch.distributed.nn``.

Each case runs in a fresh interpreter (one gloo rank, a file store): whether that torch module
is already imported, and when, is the very thing under test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                       reason="reads thread names from /proc"),
]

#: ``{first}`` is imported before ``init_process_group``, ``{later}`` after it. The script
#: then makes an optimizer (torch's lazy imports run there), destroys the process group and
#: prints what is left: pinned group defaults, the gloo worker threads still running.
SCRIPT = """
import sys, gc
import torch, torch.distributed as dist
{first}
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
{later}
from cp_core.comm.world_defaults import gloo_worker_threads, pinned_groups
model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
t = torch.ones(4)
dist.all_reduce(t)
pinned = pinned_groups()
del model, opt, t
dist.destroy_process_group()
gc.collect()
print("pinned", pinned, "gloo workers", gloo_worker_threads(), flush=True)
"""


def _run(tmp_path: Path, first: str, later: str) -> tuple[int, int]:
    """``(pinned defaults, gloo worker threads after teardown)`` of :data:`SCRIPT`."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(first=first, later=later))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    words = proc.stdout.split()
    return int(words[words.index("pinned") + 1]), int(words[words.index("workers") + 1])


def test_cp_core_imported_first_keeps_the_default_group_unpinned(tmp_path: Path) -> None:
    pinned, workers = _run(tmp_path, first="import cp_core", later="")
    assert pinned == 0
    # destroy_process_group() freed the default group: its worker threads were joined then,
    # not left to the interpreter's teardown.
    assert workers == 0


def test_without_it_the_optimizer_pins_the_default_group(tmp_path: Path) -> None:
    """The case above has teeth: cp_core imported only after ``init_process_group`` cannot
    help, the optimizer's imports bind the live default group into torch's signatures and
    that group's worker threads outlive ``destroy_process_group()``."""
    pinned, workers = _run(tmp_path, first="", later="import cp_core")
    assert pinned > 0
    assert workers > 0
