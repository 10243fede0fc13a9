"""te_thd's run-based host plan against the per-token definitions it replaced.

:func:`cp_te.local_slots.local_slots` describes a rank's slots per run of the partition and
:func:`cp_te.local_slots.all_rank_runs` merges every rank's runs in one vectorised pass. The
truth here is the old per-token route, kept in :mod:`cp_te.stream` and :mod:`cp_te.partition`:
``ThdStream.build`` + ``partition_rank_runs`` (``RankRuns.build``'s merge), then
``locate`` / ``caller_source`` / ``last_caller_token`` on every local slot. Batches are
random documents with pad at row starts and ends, holes inside documents, several rows and
empty rows, at cp 1, 2, 3 and 8 and per-chunk multiples 1 and 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_core.backend_api import thd_document_divisor
from cp_te.local_slots import HostStream, all_rank_runs, local_slots
from cp_te.partition import partition_rank_runs
from cp_te.stream import ThdStream

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_host_batches import random_ids  # noqa: E402
from thd_segments_truth import segments_from_document_ids  # noqa: E402

CPS = (1, 2, 3, 8)


def reference(segments, divisor: int, cp: int, rank: int) -> dict:
    """The old per-token route (every local slot located in the stream)."""
    stream = ThdStream.build(segments, divisor)
    runs = partition_rank_runs(stream.cu_seqlens_padded(), cp)
    local = runs.local_indices(rank)
    seg, offset = stream.locate(local)
    src = stream.caller_source(seg, offset)
    token, steps = stream.last_caller_token(seg, offset)
    return {"stream": stream, "runs": runs, "local": local, "src": src, "token": token,
            "steps": steps, "boundary_pad": offset >= segments.length[seg]}


def cases(n: int, seed: int) -> list[tuple[torch.Tensor, int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        rows, seq = int(rng.integers(1, 4)), int(rng.integers(1, 60))
        ids = random_ids(rng, rows, seq, holes=i % 3 == 1, pad=i % 3 != 0)
        out.append((ids, CPS[i % len(CPS)], (1, 3)[(i // len(CPS)) % 2]))
    return out


@pytest.mark.parametrize("ids,cp,multiple", cases(48, 1234))
def test_local_slots_match_the_per_token_route(ids: torch.Tensor, cp: int, multiple: int):
    segments = segments_from_document_ids(ids)
    divisor = thd_document_divisor(cp, multiple)
    host = HostStream.build(segments, divisor)
    total_bs = ids.numel()
    for rank in range(cp):
        ref = reference(segments, divisor, cp, rank)
        slots = local_slots(host, cp, rank, torch.device("cpu"))
        added = ref["src"] < 0
        assert torch.equal(slots.stream, ref["local"])
        assert torch.equal(slots.source[~added], ref["src"][~added])
        # Added slots are overwritten, but their source must still be a valid token.
        assert bool(((slots.source >= 0) & (slots.source < total_bs)).all())
        assert torch.equal(slots.boundary_pad, ref["boundary_pad"])
        if not bool(added.any()):
            assert slots.added is None
            continue
        where = added.nonzero().flatten()
        assert torch.equal(slots.added, where)
        assert torch.equal(slots.added_last, ref["token"][where])
        assert torch.equal(slots.added_steps, ref["steps"][where])
        assert not bool((ref["steps"][~added] != 0).any())  # caller slots: no step


@pytest.mark.parametrize("ids,cp,multiple", cases(48, 99))
def test_all_rank_runs_are_the_merged_partition(ids: torch.Tensor, cp: int, multiple: int):
    segments = segments_from_document_ids(ids)
    divisor = thd_document_divisor(cp, multiple)
    ref = reference(segments, divisor, cp, 0)["runs"]
    got = all_rank_runs(HostStream.build(segments, divisor), cp)
    assert got.size == ref.size == cp
    assert got.describe() == ref.describe()
    for r in range(cp):
        assert np.array_equal(got.starts[r], ref.starts[r])
        assert np.array_equal(got.lengths[r], ref.lengths[r])
        assert got.starts[r].dtype == got.lengths[r].dtype == np.int64


@pytest.mark.parametrize("ids,cp,multiple", cases(24, 7))
def test_host_stream_is_thd_stream_build(ids: torch.Tensor, cp: int, multiple: int):
    segments = segments_from_document_ids(ids)
    divisor = thd_document_divisor(cp, multiple)
    ref = ThdStream.build(segments, divisor)
    host = HostStream.build(segments, divisor)
    got = host.thd_stream(segments)
    assert (got.divisor, got.total) == (ref.divisor, ref.total)
    for name in ("padded_span", "stream_start", "caller_start"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    cu, cu_real, max_seqlen = host.cu_seqlens(torch.device("cpu"))
    assert cu.dtype == cu_real.dtype == torch.int32
    assert torch.equal(cu, ref.cu_seqlens_padded(drop_empty=True).to(torch.int32))
    assert torch.equal(cu_real, ref.cu_seqlens_real(drop_empty=True).to(torch.int32))
    assert max_seqlen == ref.max_seqlen()


def test_more_added_slots_than_tokens_keep_sources_valid():
    # One token at cp=8 pads to 16 slots: 15 added ones, more than the batch has tokens.
    ids = torch.tensor([[1]])
    segments = segments_from_document_ids(ids)
    host = HostStream.build(segments, thd_document_divisor(8, 1))
    for rank in range(8):
        slots = local_slots(host, 8, rank, torch.device("cpu"))
        assert bool((slots.source == 0).all())
        assert slots.boundary_pad.tolist() == [rank != 0, True]
