"""Shared by the tests that run README examples under torchrun: extract one, run it, and the
per-document loss their printed numbers are held to."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def readme_example(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    text = (REPO / "README.md").read_text()
    section = text.split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"the README lost its example under {heading!r}"
    return match.group(1)


def free_port() -> int:
    """A TCP port nobody listens on now (for the c10d rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: Path, nproc: int, *args: str, timeout: int = 600
             ) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torch.distributed.run`` with ``nproc`` local gloo ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=script.parent,
    )


def document_loss_sum(model: Any, ids: Any, rows: list[list[int]]) -> tuple[Any, int]:
    """Summed next-token cross-entropy of every document of ``ids`` (``[B, S]``; ``rows``:
    the document lengths of each row) run alone through ``model`` with plain positions, and
    the number of predicted tokens: the truth without any CP code."""
    import torch
    import torch.nn.functional as F

    total, count = torch.zeros(()), 0
    for b, lens in enumerate(rows):
        start = 0
        for n in lens:
            doc = ids[b, start:start + n]
            if n > 1:
                logits = model(doc[None, :-1], position_ids=torch.arange(n - 1)[None])
                total = total + F.cross_entropy(logits[0], doc[1:], reduction="sum")
                count += n - 1
            start += n
    return total, count
