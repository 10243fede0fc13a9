"""The README's training-step example runs as written (torchrun, 4 gloo ranks: dp 2 x cp 2)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_runs import document_loss_sum, readme_example, torchrun  # noqa: E402

pytestmark = pytest.mark.multirank


#: Before the README's code: the process groups of every device mesh it makes are watched
#: through weak references.
WATCH = """import weakref as _weakref
import torch.distributed.device_mesh as _dm
_groups = []
_mesh = _dm.init_device_mesh
def _watch_mesh(*a, **k):
    m = _mesh(*a, **k)
    _groups.extend(_weakref.ref(m.get_group(i)) for i in range(m.ndim))
    return m
_dm.init_device_mesh = _watch_mesh
"""
#: After it: how many are still alive once the script's own teardown is done, and how many
#: gloo worker threads still run (any process group's, the default group's included).
REPORT = """
from cp_core.comm.world_defaults import gloo_worker_threads as _gloo_workers
print(f"groups alive {sum(r() is not None for r in _groups)} of {len(_groups)}", flush=True)
_workers = _gloo_workers()
if _workers is not None:  # thread names: Linux only
    print(f"gloo workers {_workers}", flush=True)
"""


def test_readme_training_step_runs(tmp_path: Path) -> None:
    script = tmp_path / "train_step.py"
    script.write_text(WATCH + readme_example("## A training step with a sharder") + REPORT)
    proc = torchrun(script, 4)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # The mesh's groups are freed (their gloo worker threads joined) by the script's teardown,
    # before the interpreter exits: a group alive at exit can abort the process when one of
    # its threads releases a finished collective's tensors after Python has begun to shut
    # down. With the mesh at module level they all were still alive here.
    alive = re.findall(r"groups alive (\d+) of (\d+)", proc.stdout)
    assert len(alive) == 4 and all(a == "0" and n == "2" for a, n in alive), proc.stdout
    # No group at all is left running, the default one included: torch binds the live default
    # group into torch.distributed.nn's signatures when the first optimizer imports it, unless
    # cp_core (imported before init_process_group) had that module imported first.
    workers = re.findall(r"gloo workers (\d+)", proc.stdout)
    assert workers == ["0"] * 4 or not Path("/proc/self/task").is_dir(), proc.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    # Rank 0 prints replica 0's share of the dp x cp token mean; the same three AdamW steps
    # without CP (every document run alone, next-token targets by a plain loop) print the same.
    expected = _unsharded_losses()
    assert all(abs(x - e) <= 2e-4 for x, e in zip(losses, expected)), (losses, expected)


def _unsharded_losses() -> list[float]:
    """Replica 0's printed loss of each README step, computed without any CP code: each
    document alone through the model (plain causal SDPA), targets the next token of the same
    document, the loss summed over both dp replicas' tokens and divided by their count."""
    import torch

    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.testing.reference_model import ReferenceDecoder

    torch.manual_seed(0)
    model = ReferenceDecoder(vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(3):
        sums, count = [], 0
        for replica in range(2):
            rows = packed_rows(2, 1024, seed=100 * step + replica)
            ids = make_packed_batch(rows, vocab=256, seed=step)["input_ids"]
            total, n = document_loss_sum(model, ids, rows)
            count += n
            sums.append(total)
        loss = (sums[0] + sums[1]) / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(sums[0].detach()) / count)
    return out
