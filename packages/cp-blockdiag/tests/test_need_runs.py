"""blockdiag's run-based need (what the sharder uses) against the need-matrix definition.

Random batches (documents, pad tails, pad holes inside and between documents, several rows,
CP sizes 1/2/3/4/8) must give the same need, halo verdict, traffic summaries, exchange
decision (or the same error) and every rank's route, whether the need comes from the
documents' runs (:class:`cp_blockdiag.need_runs.NeedRuns`) or from the ``[B, cp, L]`` need
matrix of :mod:`cp_blockdiag.routing`. The need itself is also checked token by token.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_blockdiag import need_runs
from cp_blockdiag.need_runs import NeedRuns
from cp_blockdiag.routing import (
    EXCHANGES,
    RESOLVED_EXCHANGES,
    build_route,
    choose_exchange,
    halo_violation,
    need_matrix,
    summarize,
)
from cp_core.testing.truth import truth_contiguous_need

CPS = (1, 2, 3, 4, 8)


def _random_ids(rng: random.Random, bsz: int, length: int, holes: bool, tail: bool
                ) -> torch.Tensor:
    """``[bsz, length]`` canonical document ids (1, 2, ... per row, 0 == pad): documents of
    random lengths, with pad holes inside and between documents when ``holes``, and a pad
    tail of random length when ``tail``."""
    out = torch.zeros(bsz, length, dtype=torch.long)
    for b in range(bsz):
        real = rng.randint(1, length) if tail else length
        p, doc = 0, 0
        while p < real:
            if holes and p > 0 and rng.random() < 0.3:  # a gap between documents
                p += rng.randint(1, 3)
                continue
            doc += 1
            end = min(real, p + rng.randint(1, max(1, length // 2)))
            out[b, p:end] = doc
            if holes and end - p > 2 and rng.random() < 0.5:  # a hole inside the document
                h = rng.randrange(p + 1, end - 1)
                out[b, h:h + rng.randint(1, 2)] = 0
            p = end
        out[b, real:] = 0
    return out


def _as_matrix(runs: NeedRuns, length: int) -> torch.Tensor:
    out = torch.zeros(runs.batch_size, runs.cp, length, dtype=torch.bool)
    for b, r, s, e in zip(runs.row, runs.rank, runs.start, runs.end):
        assert s < e, "a run is never empty"
        assert not out[b, r, s:e].any(), "runs never overlap"
        out[b, r, s:e] = True
    return out


def _segments(ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``Documents.segments()``-style runs of hole-free ids (pad only after the documents)."""
    starts, ends, rows = [], [], []
    for b, row in enumerate(ids.tolist()):
        p = 0
        while p < len(row):
            if row[p] == 0:
                p += 1
                continue
            q = p
            while q < len(row) and row[q] == row[p]:
                q += 1
            starts.append(p), ends.append(q), rows.append(b)
            p = q
    arr = [np.array(a, dtype=np.int64) for a in (starts, ends, rows)]
    return arr[0], arr[1], arr[2], int(ids.shape[0])


def _assert_same_route(got, want) -> None:
    for name in ("exchange", "cp_rank", "cp_size", "batch_size", "chunk_len", "any_traffic"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.extra_index.dtype == want.extra_index.dtype == torch.long
    assert torch.equal(got.extra_index, want.extra_index)
    for field in ("send_index", "recv_slot"):
        g, w = getattr(got, field), getattr(want, field)
        assert len(g) == len(w), field
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and torch.equal(a, b), field


def _outcome(fn, *args):
    """The result of ``fn(*args)``, or the type and message of what it raised."""
    try:
        return fn(*args)
    except Exception as exc:  # the two paths must fail alike
        return type(exc), str(exc)


def _assert_same_as_matrix(runs: NeedRuns, ids: torch.Tensor, cp: int) -> None:
    need = need_matrix(ids, cp)
    assert torch.equal(_as_matrix(runs, ids.shape[1]), need)
    assert runs.halo_violation() == halo_violation(need, cp)
    for exchange in RESOLVED_EXCHANGES:
        assert runs.summarize(exchange) == summarize(need, cp, exchange)
    for exchange in EXCHANGES:
        want = _outcome(choose_exchange, need, cp, exchange)
        assert _outcome(runs.choose, exchange) == want
        if isinstance(want, tuple):  # the error: no route to build
            continue
        for rank in range(cp):
            _assert_same_route(runs.route(rank, exchange),
                               build_route(ids, cp, rank, exchange, need=need))


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("holes,tail", [(False, False), (False, True), (True, True)])
def test_runs_from_ids_equal_the_need_matrix(cp: int, holes: bool, tail: bool) -> None:
    rng = random.Random(100 * cp + 10 * holes + tail)
    for _ in range(25):
        length = cp * rng.randint(1, 7)
        ids = _random_ids(rng, rng.randint(1, 4), length, holes, tail)
        runs = NeedRuns.from_ids(ids, cp)
        assert torch.equal(_as_matrix(runs, length), truth_contiguous_need(ids, cp))
        _assert_same_as_matrix(runs, ids, cp)


@pytest.mark.parametrize("cp", CPS)
def test_runs_from_segments_equal_the_need_matrix(cp: int) -> None:
    """Segments over the caller's length; the rows padded to a multiple of ``cp`` beyond it
    (and any row ending early) are pad, as the ids say."""
    rng = random.Random(cp)
    for _ in range(25):
        length = cp * rng.randint(1, 7)
        ids = _random_ids(rng, rng.randint(1, 4), length, holes=False, tail=rng.random() < 0.5)
        runs = NeedRuns.from_segments(_segments(ids), cp, length)
        _assert_same_as_matrix(runs, ids, cp)
        assert torch.equal(_as_matrix(runs, length), truth_contiguous_need(ids, cp))


def test_a_hole_spanning_a_whole_chunk_still_routes_the_rest_of_the_document() -> None:
    # Document 1 covers chunks 0..3 of a row, chunk 1 is a hole: rank 3 needs chunks 0 and 2
    # (from owners 0 and 2), rank 2 needs chunk 0, and nothing of the hole moves.
    ids = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1]])
    runs = NeedRuns.from_ids(ids, 4)
    assert torch.equal(_as_matrix(runs, 8), truth_contiguous_need(ids, 4))
    assert runs.owner_counts().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 0],
                                            [2, 0, 2, 0]]
    assert runs.halo_violation() == (0, 2, 0)
    _assert_same_as_matrix(runs, ids, 4)


def test_no_traffic_and_empty_batches() -> None:
    ids = torch.tensor([[1, 1, 2, 2, 3, 3, 0, 0]])  # every document within one chunk
    runs = NeedRuns.from_ids(ids, 4)
    assert len(runs.start) == 0 and runs.choose() == "halo"
    assert not runs.route(1, "a2a").any_traffic
    _assert_same_as_matrix(runs, ids, 4)
    pad = torch.zeros(2, 8, dtype=torch.long)
    _assert_same_as_matrix(NeedRuns.from_ids(pad, 4), pad, 4)


def test_many_rows_take_the_vectorised_paths() -> None:
    # More (row, rank) needs, and more runs of one receiver, than the per-range loop serves.
    rng = random.Random(5)
    for holes in (False, True):
        ids = _random_ids(rng, 48, 8 * 4, holes, tail=False)
        runs = NeedRuns.from_ids(ids, 8)
        assert int(np.bincount(runs.rank).max()) > need_runs._FEW_RANGES
        assert torch.equal(_as_matrix(runs, ids.shape[1]), truth_contiguous_need(ids, 8))
        _assert_same_as_matrix(runs, ids, 8)


@pytest.mark.parametrize("count", [0, 3, 40, 200])
def test_range_helpers_match_python(count: int) -> None:
    rng = np.random.default_rng(count)
    starts = rng.integers(0, 50, count)
    ends = starts + rng.integers(-2, 8, count)  # some empty (or reversed) ranges
    want = [p for a, b in zip(starts, ends) for p in range(a, b)]
    assert need_runs._ranges(starts, ends).tolist() == want
    keep = ends > starts
    lo, hi = need_runs._merged(starts[keep], ends[keep])
    covered = sorted(set(want))
    assert need_runs._ranges(lo, hi).tolist() == covered
    assert bool((lo[1:] > hi[:-1]).all())  # disjoint and not touching
