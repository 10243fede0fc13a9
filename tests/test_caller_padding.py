"""Caller padding anywhere (left, holes, right) and a non-default pad token, on every backend.

A collator may pad on the left, leave pad holes inside a document, or pad on the right; a
backend that reads only trailing padding, or that fills its own pad slots with 0 instead of
``padding_token_id``, trains on garbage without an error. Every installed backend shards such
batches on every simulated rank, and each local slot is checked against the caller's batch
by plain loops (:mod:`cp_core.testing.fills`): a slot that holds caller token ``(b, s)``
carries that token's id, label, position (the caller's, else ``s``) and pad flag; a slot the
layout added carries ``padding_token_id``, label -100 and pad True. For te_thd, ``cu_seqlens_padded`` and
``cu_seqlens_unpadded`` are recomputed from the documents by loops (never across input
formats). Parity of such batches with the truth runs in ``test_cross_backend.py`` (form
``left_padding``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cp_core.errors import CPConfigError
from cp_core.comm.mesh import SimulatedCPMesh
from cp_core.registry import build_sharder
from cp_core.testing.fills import check_local_fills
from cp_core.testing import installed

_installed = installed

BACKENDS = ("identity", "contiguous", "round_robin", "aux_only", "te_thd", "magi", "blockdiag")
PAD_ID = 5

#: Rows of ``(kind, n)`` runs: "pad" caller pad, "doc" a new document, "hole" pad inside the
#: current document (the document goes on after it).
ROWS = (
    (("pad", 3), ("doc", 4), ("hole", 1), ("doc", 3), ("doc", 5), ("pad", 3)),
    (("doc", 2), ("doc", 7), ("hole", 2), ("doc", 3), ("pad", 5)),
)


def caller_batch(with_positions: bool, seed: int = 0) -> tuple[dict[str, Any], list[list[int]]]:
    """The batch of :data:`ROWS` (``attention_mask`` 0 on pad) and its per-token document
    numbers (0 on pad) by loops. A hole continues its document's positions."""
    seq = sum(n for _, n in ROWS[0])
    assert all(sum(n for _, n in r) == seq for r in ROWS)
    docs, pos = [], []
    for row in ROWS:
        d, p, drow, prow = 0, 0, [], []
        for kind, n in row:
            if kind == "doc":
                d, p = d + 1, 0
            for _ in range(n):
                drow.append(d if kind != "pad" else 0)
                if kind == "hole":
                    drow[-1] = 0
                prow.append(p)
                p += 1
        docs.append(drow)
        pos.append(prow)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (len(ROWS), seq), generator=g)
    valid = torch.tensor(docs) != 0
    labels = torch.randint(0, 60, (len(ROWS), seq), generator=g).masked_fill(~valid, -100)
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels, "attention_mask": valid.long()}
    if with_positions:
        batch["position_ids"] = torch.tensor(pos)
    else:  # the documents then come from their ids
        batch["_packed_seq_ids"] = torch.tensor(docs)
    return batch, docs


def _sharder(backend: str, cp: int, rank: int, **extra: Any) -> tuple[Any, int]:
    """A sharder with ``padding_token_id=PAD_ID``, or 0 where the backend refuses another."""
    mesh = SimulatedCPMesh(rank, cp)
    try:
        return build_sharder({"backend": backend, "size": cp, "padding_token_id": PAD_ID,
                              **extra}, mesh), PAD_ID
    except CPConfigError as exc:
        assert "padding_token_id" in str(exc), exc  # refused by name, not by accident
        return build_sharder({"backend": backend, "size": cp, **extra}, mesh), 0


def check_fills(backend: str, cp: int, with_positions: bool, **extra: Any) -> None:
    batch, docs = caller_batch(with_positions)
    pad = [[d == 0 for d in row] for row in docs]
    for rank in range(cp):
        sharder, pad_id = _sharder(backend, cp, rank, **extra)
        _, local = sharder.shard(batch)
        check_local_fills(batch, pad, local, sharder.shard_layout, pad_id,
                          where=(backend, cp, rank, with_positions, extra),
                          primary_sharded=backend != "aux_only")


@pytest.mark.parametrize("with_positions", [True, False], ids=["positions", "no_positions"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_caller_padding_anywhere_keeps_every_token_and_fills_the_layouts_pad(
        backend: str, with_positions: bool) -> None:
    if not _installed.loadable(backend):
        pytest.skip(f"backend {backend!r} is not installed or does not load")
    for cp in ((1,) if backend == "identity" else (1, 2, 3)):
        check_fills(backend, cp, with_positions)


@pytest.mark.parametrize("extra", [{"pad_multiple": 3}, {"rows": True}],
                         ids=["pad_multiple", "rows"])
def test_caller_padding_with_te_options(extra: dict[str, Any]) -> None:
    if not _installed.loadable("te_thd"):
        pytest.skip("te_thd is not installed")
    from cp_core.registry import get_backend

    missing = set(extra) - set(get_backend("te_thd").config_model.model_fields)
    if missing:
        pytest.skip(f"te_thd has no config key {sorted(missing)} here")
    for cp in (2, 3):
        check_fills("te_thd", cp, True, **extra)


def _te_segments(docs: list[list[int]]) -> list[tuple[int, int]]:
    """te_thd's segments by loops: ``(real length, span)`` per segment in stream order. A
    segment starts at each row start and at each document's first token; it runs to the
    next start (the pad after a document is its span), its real length to the document's
    last real token (holes inside count, they are masked by the pad flag)."""
    out = []
    for row in docs:
        starts, seen = [0], set()
        for s, d in enumerate(row):
            if d and d not in seen:
                seen.add(d)
                if s:
                    starts.append(s)
        for a, b in zip(starts, starts[1:] + [len(row)]):
            real = [s for s in range(a, b) if row[s]]
            out.append((real[-1] - a + 1 if real else 0, b - a))
    return out


@pytest.mark.parametrize("pad_multiple", [1, 3])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_te_cu_seqlens_from_the_documents_by_loops(cp: int, pad_multiple: int) -> None:
    if not _installed.loadable("te_thd"):
        pytest.skip("te_thd is not installed")
    batch, docs = caller_batch(True)
    divisor = 2 * cp * pad_multiple
    segments = _te_segments(docs)
    padded, unpadded = [0], [0]
    for real, span in segments:
        if span:
            padded.append(padded[-1] + -(-span // divisor) * divisor)
            unpadded.append(unpadded[-1] + real)
    for rank in range(cp):
        sharder = build_sharder({"backend": "te_thd", "size": cp, "pad_multiple": pad_multiple},
                                SimulatedCPMesh(rank, cp))
        _, local = sharder.shard(batch)
        assert local["cu_seqlens_padded"].tolist() == padded, (cp, rank)
        assert local["cu_seqlens"].tolist() == padded, (cp, rank)
        assert local["cu_seqlens_unpadded"].tolist() == unpadded, (cp, rank)
        assert local["max_seqlen"] == max(b - a for a, b in zip(padded, padded[1:]))
        assert sharder.shard_layout.padded_seq_len == padded[-1]
        assert local["input_ids"].numel() == padded[-1] // cp
