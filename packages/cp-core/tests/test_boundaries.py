"""The shared boundary parser: trailing pad, sentinels, document ids, and pad holes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cp_core import SimulatedCPMesh
from cp_core.attention.intercept import active_plan
from cp_core.boundaries import resolve_segments, segment_document_ids
from cp_core.documents import document_positions
from cp_core.errors import CPBatchError
from cp_core.registry import build_sharder
from cp_core.testing.multirank import load_module_file

CPU = torch.device("cpu")
# Document ids written out from lengths, independently of the parser under test.
_reference = load_module_file(Path(__file__).with_name("attention_reference.py"))
_ids_by_hand = _reference.doc_ids_from_lengths


def test_trailing_pad_allows_rows_that_end_early() -> None:
    batch = {"seq_lens": torch.tensor([[3, 2, -1000], [4, -1000, -1000]])}
    with pytest.raises(CPBatchError):
        resolve_segments(batch, 2, 8, CPU)  # te's rule: documents fill the row exactly
    segs = resolve_segments(batch, 2, 8, CPU, trailing_pad=True)
    ids = segment_document_ids(segs)
    assert torch.equal(ids, _ids_by_hand([[3, 2], [4]], 8))
    assert int(segs.span.sum()) == 16  # the spans tile both rows, pad included


def test_sentinel_none_accepts_any_negative_end_marker() -> None:
    batch = {"seq_lens": torch.tensor([[3, 5, -1]])}
    segs = resolve_segments(batch, 1, 8, CPU, sentinel=None)
    assert torch.equal(segment_document_ids(segs), _ids_by_hand([[3, 5]], 8))
    with pytest.raises(CPBatchError, match="sentinel"):
        resolve_segments({"seq_lens": torch.tensor([[3, -1, 5]])}, 1, 8, CPU, sentinel=None)


def test_every_source_gives_the_same_document_ids() -> None:
    lens = [[2, 3, 3], [5, 3]]
    want = _ids_by_hand(lens, 8)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in lens])
    sources = [
        {"seq_lens": torch.tensor([[2, 3, 3], [5, 3, -1000]])},
        {"cu_seqlens": torch.tensor([[0, 2, 5, 8], [0, 5, 8, -1000]])},
        {"_packed_seq_ids": want},
        {"position_ids": pos},
    ]
    for batch in sources:
        assert torch.equal(segment_document_ids(resolve_segments(batch, 2, 8, CPU)), want), batch


def test_pad_hole_inside_a_document_keeps_positions_counting() -> None:
    ids = torch.tensor([[1, 1, 0, 1, 1, 2, 2]])
    assert document_positions(ids)[0, [0, 1, 3, 4, 5, 6]].tolist() == [0, 1, 3, 4, 0, 1]


@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_pad_hole_never_lets_a_query_see_a_later_key(backend: str) -> None:
    ids = torch.tensor([[1, 1, 0, 1, 1, 2, 2, 2]])
    batch = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8),
             "_packed_seq_ids": ids}
    sharder = build_sharder({"backend": backend, "size": 2}, SimulatedCPMesh(0, 2))
    ctx, _ = sharder.shard(batch)
    with ctx():
        plan = active_plan()
    allowed = plan.mask.block(torch.arange(8), torch.arange(8))[0]
    q, k = allowed.nonzero(as_tuple=True)
    assert bool((k <= q).all()), "a query attends a later key"
    same_doc = ids[0, q] == ids[0, k]
    assert bool(same_doc.all()) and bool((ids[0, k] > 0).all())
    # every real token of document 1 sees every earlier real token of document 1
    assert allowed[4, [0, 1, 3, 4]].all() and not allowed[4, 2]
