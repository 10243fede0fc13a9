"""The p2p schedule from runs, vectorised: rectangles cropped to rank runs with numpy.

:func:`cp_core.attention.slices.build_rank_slices` crops one (rectangle, query run, key run)
triple at a time in Python; that is the readable definition, and the test reference. This
module computes the same crops for one rank with array operations over all triples at once:

* pass A, this rank's queries against every rank's keys: the pieces it computes and the key
  ranges it receives from each owner;
* pass B, every other rank's queries against this rank's keys: the ranges it sends to each.

Each pass costs O(rectangles x runs they overlap), found by binary search over the sorted,
disjoint runs, so a rank's host work follows its own runs and the documents, never the
tokens. Only the pieces that need cutting (causal squares, band tiles) go through Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_core.attention.rects import INF, BandRects
from cp_core.attention.slices import FULL, Piece, _pieces
from cp_core.runs import RankRuns


@dataclass(frozen=True)
class RunTable:
    """Runs sorted by global start: ``[start, end)``, local row of ``start``, owner rank."""

    start: np.ndarray
    end: np.ndarray
    local: np.ndarray
    owner: np.ndarray

    @classmethod
    def of(cls, runs: RankRuns, ranks: list[int]) -> "RunTable":
        """The runs of ``ranks`` in one table (cached on ``runs``)."""
        key = ("run_table", tuple(ranks))
        got = runs.cache.get(key)
        if got is None:
            got = runs.cache[key] = cls._build(runs, ranks)
        return got

    @classmethod
    def _build(cls, runs: RankRuns, ranks: list[int]) -> "RunTable":
        st = [runs.starts[r] for r in ranks]
        ln = [runs.lengths[r] for r in ranks]
        lo = [runs.local_offsets(r) for r in ranks]
        ow = [np.full(s.size, r, np.int64) for r, s in zip(ranks, st)]
        start = np.concatenate(st) if st else np.zeros(0, np.int64)
        order = np.argsort(start, kind="stable")
        end = (start + (np.concatenate(ln) if ln else np.zeros(0, np.int64)))
        return cls(start[order], end[order], np.concatenate(lo)[order] if lo else start,
                   np.concatenate(ow)[order] if ow else start)


def _overlaps(lo: np.ndarray, hi: np.ndarray, table: RunTable) -> tuple[np.ndarray, np.ndarray]:
    """``(item, run)`` for every run of ``table`` overlapping ``[lo[item], hi[item])``."""
    # Runs are disjoint and sorted, so their ends are sorted too: the overlapping runs of an
    # interval are one index range.
    first = np.searchsorted(table.end, lo, side="right")
    last = np.searchsorted(table.start, hi, side="left")
    count = np.maximum(last - first, 0)
    item = np.repeat(np.arange(lo.size), count)
    base = np.repeat(first - (np.cumsum(count) - count), count)
    return item, base + np.arange(item.size)


@dataclass(frozen=True)
class Boxes:
    """Tightened crops in local coordinates: query rows of the query owner, key rows of the
    key owner, the band bounds shifted to ``d = k_local - q_local``."""

    b: np.ndarray
    q_owner: np.ndarray
    k_owner: np.ndarray
    q0: np.ndarray
    q1: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    dlo: np.ndarray
    dhi: np.ndarray


def crop(rects: BandRects, queries: RunTable, keys: RunTable) -> Boxes:
    """Every rectangle cropped to (query run x key run), tightened (see ``slices._tighten``)."""
    rows = rects.rows
    b, qs, qe, ks, ke, dlo, dhi = (rows[:, i] for i in range(7))
    item, qr = _overlaps(qs, qe, queries)
    b, qs, qe, ks, ke, dlo, dhi = (x[item] for x in (b, qs, qe, ks, ke, dlo, dhi))
    a = np.maximum(qs, queries.start[qr])
    e = np.minimum(qe, queries.end[qr])
    # Keys this query range can reach at all, so runs outside the band are never visited.
    lo_k = np.where(dlo > -INF, np.maximum(ks, a + dlo), ks)
    hi_k = np.where(dhi < INF, np.minimum(ke, e + dhi), ke)
    item2, kr = _overlaps(lo_k, hi_k, keys)
    b, a, e, dlo, dhi, qr = (x[item2] for x in (b, a, e, dlo, dhi, qr))
    c = np.maximum(lo_k[item2], keys.start[kr])
    f = np.minimum(hi_k[item2], keys.end[kr])
    # Tighten: the smallest box of the band with every row and key used.
    q0 = np.maximum(a, c - dhi)
    q1 = np.minimum(e, f - dlo)
    k0 = np.maximum(c, q0 + dlo)
    k1 = np.minimum(f, q1 + dhi)
    keep = (dlo <= dhi) & (c < f) & (q0 < q1) & (k0 < k1)
    b, q0, q1, k0, k1, dlo, dhi, qr, kr = (x[keep] for x in (b, q0, q1, k0, k1, dlo, dhi,
                                                             qr, kr))
    dhi = np.where(q0 + dhi >= k1 - 1, INF, dhi)  # even the first row sees the last key
    dlo = np.where(q1 - 1 + dlo <= k0, -INF, dlo)  # even the last row sees the first key
    qoff = queries.local[qr] - queries.start[qr]
    koff = keys.local[kr] - keys.start[kr]
    shift = koff - qoff
    return Boxes(b, queries.owner[qr], keys.owner[kr], q0 + qoff, q1 + qoff, k0 + koff,
                 k1 + koff, np.where(dlo > -INF, dlo + shift, -INF),
                 np.where(dhi < INF, dhi + shift, INF))


def merged_ranges(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray
                  ) -> dict[int, list[tuple[int, int]]]:
    """Per owner, the sorted union of its ``[lo, hi)`` ranges."""
    if owner.size == 0:
        return {}
    order = np.lexsort((lo, owner))
    owner, lo, hi = owner[order], lo[order], hi[order]
    # Offsetting by owner keeps the running maximum of ends from leaking across owners.
    big = int(max(hi.max(), 1)) + 1
    ends = np.maximum.accumulate(hi + owner * big)
    prev = np.concatenate(([-1], ends[:-1]))
    new = (lo + owner * big) > prev
    starts = np.flatnonzero(new)
    stops = np.concatenate((starts[1:], [owner.size])) - 1
    out: dict[int, list[tuple[int, int]]] = {}
    for o, a, z in zip(owner[starts].tolist(), lo[starts].tolist(),
                       (ends[stops] - owner[stops] * big).tolist()):
        out.setdefault(o, []).append((a, z))
    return out


#: Columns of a piece row: the fields of :class:`~cp_core.attention.slices.Piece` in order.
_B, _Q0, _Q1, _SRC, _K0, _K1, _KIND, _DLO, _DHI = range(9)


def _rows_of(pieces: list[Piece]) -> np.ndarray:
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 9)


def pieces_by_owner(boxes: Boxes) -> dict[int, np.ndarray]:
    """Kernel pieces of the boxes as ``[P, 9]`` rows (:class:`Piece` fields), per key owner.

    FULL boxes are rows as they are; causal and band boxes are cut by ``slices._pieces``.
    """
    full = (boxes.dlo == -INF) & (boxes.dhi == INF)
    n = int(full.sum())
    rows = np.empty((n, 9), np.int64)
    for col, x in ((_B, boxes.b), (_Q0, boxes.q0), (_Q1, boxes.q1), (_SRC, boxes.k_owner),
                   (_K0, boxes.k0), (_K1, boxes.k1)):
        rows[:, col] = x[full]
    rows[:, _KIND], rows[:, _DLO], rows[:, _DHI] = FULL, -INF, INF
    cut: list[Piece] = []
    rest = ~full
    for args in zip(*(x[rest].tolist() for x in (boxes.b, boxes.q0, boxes.q1, boxes.k_owner,
                                                  boxes.k0, boxes.k1, boxes.dlo, boxes.dhi))):
        _pieces(*args, cut)
    both = np.concatenate((rows, _rows_of(cut)))
    order = np.argsort(both[:, _SRC], kind="stable")
    both = both[order]
    owners, first = np.unique(both[:, _SRC], return_index=True)
    bounds = [*first.tolist(), both.shape[0]]
    return {int(o): both[bounds[i]:bounds[i + 1]] for i, o in enumerate(owners.tolist())}


def _merge_runs(rows: np.ndarray, same: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """FULL rows with equal ``same`` columns whose ``[lo, hi)`` touch, merged (one pass of
    :func:`~cp_core.attention.slices.merge_full_pieces`)."""
    if rows.shape[0] < 2:
        return rows
    rows = rows[np.lexsort(tuple(rows[:, c] for c in (lo, *reversed(same))))]
    cont = np.ones(rows.shape[0] - 1, bool)
    for c in same:
        cont &= rows[1:, c] == rows[:-1, c]
    cont &= rows[1:, lo] == rows[:-1, hi]
    start = np.concatenate(([True], ~cont))
    group = np.cumsum(start) - 1
    out = rows[start].copy()
    last = np.zeros(out.shape[0], np.int64)
    np.maximum.at(last, group, np.arange(rows.shape[0]))
    out[:, hi] = rows[last, hi]
    return out


def merge_full_rows(rows: np.ndarray) -> np.ndarray:
    """:func:`~cp_core.attention.slices.merge_full_pieces` on piece rows, vectorised."""
    full = rows[:, _KIND] == FULL
    merged = _merge_runs(rows[full], (_B, _SRC, _Q0, _Q1), _K0, _K1)
    merged = _merge_runs(merged, (_B, _SRC, _K0, _K1), _Q0, _Q1)
    return np.concatenate((rows[~full], merged))


def buffer_rows(rows: np.ndarray, needed: list[tuple[int, int]]) -> np.ndarray:
    """:func:`~cp_core.attention.slices.to_buffer_coords` on piece rows, vectorised."""
    starts = np.asarray([a for a, _ in needed], np.int64)
    lens = np.asarray([b - a for a, b in needed], np.int64)
    offsets = np.cumsum(lens) - lens
    i = np.searchsorted(starts, rows[:, _K0], side="right") - 1
    shift = offsets[i] - starts[i]
    out = rows.copy()
    out[:, _K0] += shift
    out[:, _K1] += shift
    return out


def _as_pieces(rows: np.ndarray) -> list[Piece]:
    return [Piece._make(r) for r in rows.tolist()]


def schedule_parts(rects: BandRects, runs: RankRuns, rank: int
                   ) -> tuple[list[Piece], list[tuple[int, list[tuple[int, int]], list[Piece], int,
                                                    list[tuple[int, int]]]]]:
    """This rank's local pieces and, per ring step ``i``, ``(src, recv ranges, pieces in
    buffer coordinates, dst, send ranges)`` — what :class:`~cp_core.attention.p2p.RingStep`
    holds."""
    size = runs.size
    me = RunTable.of(runs, [rank])
    everyone = RunTable.of(runs, list(range(size)))
    mine = crop(rects, me, everyone)
    recv = merged_ranges(mine.k_owner, mine.k0, mine.k1)
    by_src = pieces_by_owner(mine)
    others = [r for r in range(size) if r != rank]
    theirs = crop(rects, RunTable.of(runs, others), me) if others else None
    send = merged_ranges(theirs.q_owner, theirs.k0, theirs.k1) if theirs is not None else {}
    none = np.zeros((0, 9), np.int64)
    local = _as_pieces(merge_full_rows(by_src.get(rank, none)))
    steps = []
    for i in range(1, size):
        src, dst = (rank - i) % size, (rank + i) % size
        ranges = recv.get(src, [])
        # In the buffer, ranges that were apart on the owner sit back to back: merge again.
        pieces = _as_pieces(merge_full_rows(buffer_rows(merge_full_rows(by_src[src]), ranges))) \
            if ranges else []
        steps.append((src, ranges, pieces, dst, send.get(dst, [])))
    return local, steps


__all__ = ["RunTable", "Boxes", "crop", "merged_ranges", "pieces_by_owner", "merge_full_rows",
           "buffer_rows", "schedule_parts"]
