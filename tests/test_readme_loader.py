"""The README's long-sequence example (sharding in the DataLoader's workers) runs as written
(torchrun, 2 gloo ranks, cp=2, magi) and prints the loss the same three AdamW steps give
without any CP code."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_runs import document_loss_sum, readme_example, torchrun  # noqa: E402

pytestmark = pytest.mark.multirank


def test_readme_loader_example_runs(tmp_path: Path) -> None:
    script = tmp_path / "train_loader.py"
    script.write_text(readme_example("## Long sequences: shard in the data loader's workers"))
    proc = torchrun(script, 2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    expected = _unsharded_losses()
    assert all(abs(x - e) <= 2e-4 for x, e in zip(losses, expected)), (losses, expected)


def _unsharded_losses() -> list[float]:
    """Each step's token-mean loss computed without any CP code: every document alone through
    the model (plain causal SDPA), targets the next token of the same document."""
    import torch

    from cp_core.datasets import make_packed_batch, packed_rows
    from cp_core.testing.reference_model import ReferenceDecoder

    model = ReferenceDecoder(vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(3):
        rows = packed_rows(1, 4096, seed=step)
        ids = make_packed_batch(rows, vocab=256, seed=step)["input_ids"]
        total, count = document_loss_sum(model, ids, rows)
        loss = total / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out
