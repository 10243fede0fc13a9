"""The stairs construction of the locality layout against independent counts, in one process.

Truths are written from the definitions, not from the library: the allowed (query, key)
pairs of a packed stream as a dense boolean matrix (same document, key real, not after the
query, within the window or the chunk); a rank's work is the number of allowed pairs of its
queries, the rows it receives the keys some query of it may see that it does not hold. Every
stairs placement must give every rank exactly its share, cover the stream once, and report
the work and received rows the truth counts from its runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cp_core.backend_api import SimulatedCPMesh
from cp_core.datasets import make_packed_batch, packed_rows
from cp_core.registry import build_sharder
from cp_magi.locality.bins import FREE
from cp_magi.locality.lean import round_robin_recv
from cp_magi.locality.solver import _measure, solve
from cp_magi.locality.stairs import _everything, search, stairs
from cp_magi.locality.units import Units, build_units, kind_model

KINDS: dict[str, dict[str, Any]] = {
    "causal": {}, "sliding_window": {"window": 37}, "chunked": {"chunk": 50},
    "bidirectional": {},
}


def truth_allowed(lengths: list[int], padded: int, kind: str, window: int | None = None,
                  chunk: int | None = None) -> torch.Tensor:
    """Bool ``[padded, padded]``: may query row ``q`` see key row ``k`` (pad after)."""
    doc = torch.zeros(padded, dtype=torch.long)
    pos = torch.zeros(padded, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths, start=1):
        doc[start:start + n] = d
        pos[start:start + n] = torch.arange(n)
        start += n
    q, k = pos[:, None], pos[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (doc[None, :] > 0)
    if kind != "bidirectional":
        allowed &= k <= q
    if kind == "sliding_window":
        allowed &= q - k < window
    if kind == "chunked":
        allowed &= q // chunk == k // chunk
    return allowed


def truth_counts(allowed: torch.Tensor, indices: list[torch.Tensor]
                 ) -> tuple[list[int], list[int]]:
    """Per rank: allowed pairs of its queries, and key rows it needs but does not hold."""
    work, recv = [], []
    for idx in indices:
        own = torch.zeros(allowed.shape[0], dtype=torch.bool)
        own[idx] = True
        rows = allowed[idx]
        work.append(int(rows.sum()))
        recv.append(int((rows.any(dim=0) & ~own).sum()))
    return work, recv


def stream_indices(units: Units, holdings: list[dict[int, list[tuple[int, int]]]]
                   ) -> list[torch.Tensor]:
    """Every rank's stream rows from its holdings (unit-relative parts, free slots as
    stream ranges)."""
    out = []
    for held in holdings:
        rows = [np.arange(0, 0)]
        for u, parts in held.items():
            base = 0 if u == FREE else int(units.starts[u])
            rows += [np.arange(base + a, base + b) for a, b in parts]
        out.append(torch.from_numpy(np.concatenate(rows).astype(np.int64)))
    return out


def row_units(lengths: list[int], padded: int, kind: str) -> Units:
    """The units of one packed row under ``kind`` (the library's own unit builder: what is
    checked is the placement of them, against the truth)."""
    extra = KINDS[kind]
    ends = np.cumsum(lengths)
    spans = np.stack([ends - np.asarray(lengths), ends], axis=1)
    return build_units(spans, padded, kind_model(kind, extra.get("window")),
                       chunk=extra.get("chunk"))


def assert_exact_partition(indices: list[torch.Tensor], padded: int, cp: int) -> None:
    """Every rank holds exactly ``padded / cp`` rows and every row is held once."""
    assert [int(i.numel()) for i in indices] == [padded // cp] * cp
    assert torch.equal(torch.cat(indices).sort().values, torch.arange(padded))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("cp", [4, 8])
def test_stairs_exact_shares_and_counts_match_the_truth(kind: str, cp: int) -> None:
    """At every bound of a coarse grid, a stairs placement (balanced or not) splits the
    stream into exact shares, and the work and received rows its caller measures are the
    truth's; the searched one is balanced within 1 %."""
    extra = KINDS[kind]
    per_rank = 128
    padded = per_rank * cp
    checked = searched = 0
    for seed in (3, 4, 5):
        lengths = packed_rows(1, padded - 3, seed, cap_fraction=0.25)[0]
        units = row_units(lengths, padded, kind)
        mean = units.total_work / cp
        allowed = truth_allowed(lengths, padded, kind, **extra)
        for bound in (0, per_rank // 2, per_rank, 2 * per_rank, padded):
            held = stairs(units, cp, per_rank, mean, 0.01, bound)
            if held is None:
                continue
            indices = stream_indices(units, held)
            assert_exact_partition(indices, padded, cp)
            work, recv = _measure(units, held)
            assert (work.tolist(), recv.tolist()) == truth_counts(allowed, indices), \
                (kind, cp, seed, bound)
            checked += 1
        rr = round_robin_recv(units, cp)
        got = search(units, cp, per_rank, mean, 0.01, 0, rr, float("inf"), partial_measure(units))
        if got is not None:
            held, work, recv = got
            indices = stream_indices(units, held)
            assert_exact_partition(indices, padded, cp)
            t_work, t_recv = truth_counts(allowed, indices)
            assert (work.tolist(), recv.tolist()) == (t_work, t_recv)
            assert max(t_work) <= 1.01 * sum(t_work) / cp, (kind, cp, seed, t_work)
            searched += 1
    assert checked > 0 and searched > 0, (kind, cp, checked, searched)


def partial_measure(units: Units):
    """The solver's measure of a placement of ``units`` (work and received rows)."""
    return lambda held: _measure(units, held)


def test_slices_never_receive_more_than_the_bound() -> None:
    """Four documents of two ranks' share each on 8 ranks of 128 rows, nothing else: under
    the least bound any layout with equal shares allows (``L - T = 128``) each lies on two
    ranks, the one with its last row receiving exactly 128 and the other its 64 head rows
    (graded head-tail), counted by the truth from the ranks' rows."""
    lengths = [256] * 4
    cp, per_rank = 8, 128
    units = row_units(lengths, cp * per_rank, "causal")
    held = stairs(units, cp, per_rank, units.total_work / cp, 0.01, 128)
    assert held is not None
    indices = stream_indices(units, held)
    assert_exact_partition(indices, cp * per_rank, cp)
    work, recv = truth_counts(truth_allowed(lengths, cp * per_rank, "causal"), indices)
    assert sorted(recv) == [64] * 4 + [128] * 4, recv
    assert max(work) <= 1.01 * sum(work) / cp
    for d in range(4):  # every document on exactly two ranks
        rows = set(range(256 * d, 256 * (d + 1)))
        assert sum(bool(rows & set(i.tolist())) for i in indices) == 2


def test_beats_round_robin_where_the_one_pass_constructions_do_not() -> None:
    """Four documents of one rank's share (one a row shorter) and one of a single row on 4
    ranks of 128: whole, one per rank, they are balanced within 1 % and nobody receives a
    key. The sweep cuts one of them at its first row (1 row received, far below
    round_robin's busiest rank, which the truth counts at 65 from its own indices, so the
    quick search stops there); the stairs, searched with ``effort="full"``, keep them whole."""
    lengths = [128, 128, 127, 128, 1]
    cp = 4
    batch = make_packed_batch([lengths], vocab=50, seed=0)
    allowed = truth_allowed(lengths, 512, "causal")
    rr_idx = []
    for r in range(cp):
        sharder = build_sharder({"backend": "round_robin", "size": cp}, SimulatedCPMesh(r, cp))
        sharder.shard(batch)
        rr_idx.append(sharder.shard_layout.local_token_global_indices)
    _, rr_recv = truth_counts(allowed, rr_idx)
    assert max(rr_recv) == 65
    quick = solve(row_units(lengths, 512, "causal"), cp)
    assert quick.method == "sweep" and int(quick.recv.max()) == 1
    placement = solve(row_units(lengths, 512, "causal"), cp, effort="full")
    assert placement.method == "stairs"
    indices = [torch.from_numpy(np.concatenate(
        [np.arange(s, s + n) for s, n in zip(st.tolist(), ln.tolist())]))
        for st, ln in zip(placement.runs.starts, placement.runs.lengths)]
    assert_exact_partition(indices, 512, cp)
    work, recv = truth_counts(allowed, indices)
    assert recv == [0, 0, 0, 0]
    assert max(work) <= 1.01 * sum(work) / cp
    assert placement.recv.tolist() == recv and placement.work.tolist() == work


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sharded_stairs_schedule_moves_the_truths_rows(kind: str) -> None:
    """Through the backend (every rank shards alone): when the stairs are the placement,
    the p2p schedule receives exactly the key rows the truth says each rank needs."""
    from cp_core.plan.schedule import schedule_for
    from cp_core.runtime.intercept import active_plan

    extra = KINDS[kind]
    lengths = [30, 128, 128, 128, 98]
    cp = 4
    batch = make_packed_batch([lengths], vocab=50, seed=1)
    indices, sched_rows, layout = [], [], None
    for r in range(cp):
        sharder = build_sharder({"backend": "locality", "attention": kind, "size": cp, **extra},
                                SimulatedCPMesh(r, cp))
        ctx, _ = sharder.shard(batch)
        layout = sharder.shard_layout
        indices.append(layout.local_token_global_indices)
        with ctx():
            sched_rows.append(schedule_for(active_plan()).recv_rows())
    assert layout is not None
    padded = layout.padded_seq_len
    assert_exact_partition(indices, padded, cp)
    work, recv = truth_counts(truth_allowed(lengths, padded, kind, **extra), indices)
    assert sched_rows == recv
    assert max(work) <= 1.01 * sum(work) / cp
    if kind == "causal":  # the sweep's busiest rank receives more here than the stairs'
        assert layout.extras["locality"].method == "stairs"


def test_same_row_same_stairs() -> None:
    """Every rank solves alone: the same row gives the same stairs every time."""
    lengths = packed_rows(1, 1024, 7, cap_fraction=0.25)[0]
    units = row_units(lengths, 1024, "causal")
    mean = units.total_work / 8
    first = search(units, 8, 128, mean, 0.01, 0, round_robin_recv(units, 8), float("inf"),
                   partial_measure(units))
    assert first is not None
    for _ in range(3):
        again = search(units, 8, 128, mean, 0.01, 0, round_robin_recv(units, 8), float("inf"),
                       partial_measure(units))
        assert again is not None
        assert again[0] == first[0]
        assert again[2].tolist() == first[2].tolist()


def test_recut_keeps_tokens_and_moves_work_where_the_ranks_need_it() -> None:
    """A stair of one 384-row document over 3 ranks of 256 rows cut in equal thirds (head
    only, in order), the rest of the ranks filled with 64-row documents: cut again, every
    rank keeps its row count, the document's rows are still held once, and the busiest
    rank's work (counted by the truth from the rows) comes down to within 1 % of the mean."""
    from cp_magi.locality.bins import Bins
    from cp_magi.locality.stairs import _recut

    lengths = [384] + [64] * 6
    cp, per_rank = 3, 256
    units = row_units(lengths, cp * per_rank, "causal")
    ranks = Bins.empty(np.full(cp, per_rank, np.int64), np.zeros(cp, np.float64))
    for r, (a, b) in enumerate([(0, 128), (128, 256), (256, 384)]):
        ranks.add(r, 0, a, b, units.model.work(384, a, b))
        for d in (1 + 2 * r, 2 + 2 * r):
            ranks.add(r, d, 0, 64, int(units.work[d]))
    allowed = truth_allowed(lengths, cp * per_rank, "causal")
    before, _ = truth_counts(allowed, stream_indices(units, ranks.parts))
    mean = sum(before) / cp
    assert max(before) > 1.5 * mean  # the last third of a causal document is the densest
    _recut(units, ranks, [(0, [(0, 128), (1, 128), (2, 128)])], mean)
    indices = stream_indices(units, ranks.parts)
    assert_exact_partition(indices, cp * per_rank, cp)
    after, _ = truth_counts(allowed, indices)
    assert ranks.work.tolist() == after
    assert max(after) <= 1.01 * mean, (before, after)


def test_no_search_where_no_long_unit_fits_as_a_stair() -> None:
    """One document of 1.5 ranks' share carrying 7.5 times the mean work, beside 2-row
    documents, on 8 ranks of 128: it fits as a stair under no bound the search may reach
    (round_robin's busiest rank, 128 rows here), so every construction would be the sand
    fill cutting it where the ranks' shares end. The search returns nothing (it used to
    level that fill, the costliest levelling, for a placement the sweep beats), and the
    solver's placement is still exact, balanced and counted as the truth counts it."""
    from cp_magi.locality.stairs import VARIANTS, lays_any, long_units

    lengths = [192] + [2] * 416
    cp, per_rank = 8, 128
    padded = cp * per_rank
    units = row_units(lengths, padded, "causal")
    mean = units.total_work / cp
    rr = round_robin_recv(units, cp)
    long_ = long_units(units, per_rank, mean * 1.005, _everything(units))
    assert long_.tolist() == [0]
    assert not any(lays_any(units, cp, per_rank, mean, 0.01, rr, lean, long_)
                   for lean, _ in VARIANTS)
    assert search(units, cp, per_rank, mean, 0.01, 192 - per_rank, rr, float("inf"),
                  partial_measure(units)) is None
    placement = solve(units, cp)
    assert placement.method != "stairs"
    indices = [torch.from_numpy(np.concatenate(
        [np.arange(s, s + n) for s, n in zip(st.tolist(), ln.tolist())]))
        for st, ln in zip(placement.runs.starts, placement.runs.lengths)]
    assert_exact_partition(indices, padded, cp)
    work, recv = truth_counts(truth_allowed(lengths, padded, "causal"), indices)
    assert max(work) <= 1.01 * sum(work) / cp
    assert placement.recv.tolist() == recv and placement.work.tolist() == work
