"""Property tests of every installed backend's layout (hypothesis, one process).

Over random packed batches (random document lengths, batch 1 to 3) and CP 1 to 8, every rank of
a :class:`SimulatedCPMesh` shards the same batch, and together the ranks must satisfy:

* their global indices partition the padded stream ``[0, padded_seq_len)``;
* every rank holds the same number of tokens;
* no CP pad slot carries a label (labels -100, and ``padding_mask`` True where present);
* ``gather(shard(x), trim=True) == x``, with the gather emulated independently: every rank's
  ``shard_token_tensor(x)`` is written back at its indices and read out in the caller's
  coordinates (through ``input_token_stream_positions`` for flat-stream layouts).

The backends are taken from the registry, so a backend that is installed is tested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_core.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing.multirank import load_module_file

_installed = load_module_file(Path(__file__).with_name("installed_backends.py"))
loadable = _installed.loadable

BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag")


@st.composite
def packed_batches(draw: Any) -> tuple[int, list[list[int]]]:
    """``(seq_len, doc_lengths_per_row)``: rows of equal length cut into 1..5 documents."""
    seq = draw(st.integers(1, 40))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(set(draw(st.lists(st.integers(1, max(seq - 1, 1)), max_size=4))))
        cuts = [c for c in cuts if 0 < c < seq]
        bounds = [0, *cuts, seq]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    return seq, rows


def make_batch(seq: int, rows: list[list[int]], seed: int) -> dict[str, Any]:
    """input_ids, labels (some -100) and document-restarting position_ids for ``rows``."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(rows)
    ids = torch.randint(1, 1000, (bsz, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(bsz, seq, generator=g) < 0.2] = -100
    pos = torch.tensor([[p for n in row for p in range(n)] for row in rows])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def check_layout(backend: str, cp: int, seq: int, rows: list[list[int]], seed: int) -> None:
    """Shard on every rank and check the four properties of the module docstring."""
    batch = make_batch(seq, rows, seed)
    bsz = len(rows)
    x = torch.randn(bsz, seq, generator=torch.Generator().manual_seed(seed + 1))
    layouts, locals_, xs = [], [], []
    for r in range(cp):
        s = build_sharder({"backend": backend, "size": cp}, SimulatedCPMesh(r, cp))
        _, out = s.shard(batch)
        layouts.append(s.shard_layout)
        locals_.append(out)
        xs.append(s.shard_token_tensor(x, fill=0.0))
    padded = layouts[0].padded_seq_len
    assert all(lay.padded_seq_len == padded for lay in layouts)
    idx = [lay.local_token_global_indices for lay in layouts]

    # partition of the padded stream, equal counts
    assert torch.equal(torch.cat(idx).sort().values, torch.arange(padded)), (backend, cp)
    assert len({i.numel() for i in idx}) == 1, [i.numel() for i in idx]

    # which stream slots hold a caller token
    positions = layouts[0].input_token_stream_positions
    real = torch.zeros(padded, dtype=torch.bool)
    if positions is not None:  # flat stream: the caller's [B, S] map into it
        real[positions[positions >= 0]] = True
    else:  # rows: the first S slots of each row
        real[:seq] = True

    for r in range(cp):
        n = idx[r].numel()
        pad_cols = ~real[idx[r]]
        labels = locals_[r]["labels"].reshape(-1, n)
        assert bool((labels[:, pad_cols] == -100).all()), (backend, cp, r, "pad slot has a label")
        pm = locals_[r].get("padding_mask")
        if isinstance(pm, torch.Tensor):
            assert bool(pm.reshape(-1, n)[:, pad_cols].all()), (backend, cp, r, "pad not masked")

    # gather(shard(x), trim=True) == x, the gather emulated by indices
    if positions is not None:
        stream = torch.full((padded,), float("nan"))
        for r in range(cp):
            stream[idx[r]] = xs[r].reshape(-1)
        kept = positions >= 0
        back = stream[positions.clamp(min=0)]
        assert torch.equal(back[kept], x[kept]), (backend, cp)
    else:
        full = torch.full((bsz, padded), float("nan"))
        for r in range(cp):
            full[:, idx[r]] = xs[r]
        assert torch.equal(full[:, :seq], x), (backend, cp)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=packed_batches(), cp=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_layout_properties(backend: str, data: tuple[int, list[list[int]]], cp: int,
                           seed: int) -> None:
    if not loadable(backend):
        pytest.skip(f"backend {backend!r} is not installed or does not load")
    if backend == "identity":
        cp = 1  # the identity layout is CP size 1 by definition
    seq, rows = data
    check_layout(backend, cp, seq, rows, seed)
