"""The boundary lists through the one resolver: trailing pad, sentinels, document ids, holes."""

from __future__ import annotations


import pytest
import torch

from cp_core import SimulatedCPMesh
from cp_core.runtime.intercept import active_plan
from cp_core.batch.documents import document_positions, resolve_documents
from cp_core.errors import CPBatchError
from cp_core.registry import build_sharder
from cp_core.testing import reference_attention

CPU = torch.device("cpu")
# Document ids written out from lengths, independently of the parser under test.
_reference = reference_attention
_ids_by_hand = _reference.doc_ids_from_lengths


TOKENS = {"input_ids": torch.ones(2, 8, dtype=torch.long)}


def _ids(batch: dict, **kw: object) -> torch.Tensor:
    return resolve_documents({**TOKENS, **batch}, **kw).ids  # type: ignore[arg-type]


def test_trailing_pad_allows_rows_that_end_early() -> None:
    # One rule on every backend: a row's documents may end early, the rest is pad.
    batch = {"seq_lens": torch.tensor([[3, 2, -1000], [4, -1000, -1000]])}
    assert torch.equal(_ids(batch), _ids_by_hand([[3, 2], [4]], 8))


def test_sentinel_none_accepts_any_negative_end_marker() -> None:
    one = {"input_ids": torch.ones(1, 8, dtype=torch.long)}
    batch = {**one, "seq_lens": torch.tensor([[3, 5, -1]])}
    assert torch.equal(resolve_documents(batch, sentinel=None).ids, _ids_by_hand([[3, 5]], 8))
    with pytest.raises(CPBatchError, match="sentinel"):
        resolve_documents({**one, "seq_lens": torch.tensor([[3, -1, 5]])}, sentinel=None)


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
        assert torch.equal(_ids(batch), want), batch


def test_pad_hole_inside_a_document_keeps_positions_counting() -> None:
    ids = torch.tensor([[1, 1, 0, 1, 1, 2, 2]])
    assert document_positions(ids)[0, [0, 1, 3, 4, 5, 6]].tolist() == [0, 1, 3, 4, 0, 1]


@pytest.mark.parametrize("backend", ["round_robin", "contiguous"])
def test_pad_hole_never_lets_a_query_see_a_later_key(backend: str) -> None:
    ids = torch.tensor([[1, 1, 0, 1, 1, 2, 2, 2]])
    batch = {"input_ids": torch.arange(8).view(1, 8),
             "labels": torch.arange(8).view(1, 8).masked_fill(ids == 0, -100),
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
