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

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from cp_core.attention.rects import INF, BandRects
from cp_core.attention.slices import CAUSAL, CAUSAL_LEAF, FULL, Piece, _pieces
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


def merged_arrays(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per owner, the sorted union of its ``[lo, hi)`` ranges: ``(owner, start, end)`` arrays
    sorted by owner then start."""
    if owner.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    order = np.lexsort((lo, owner))
    owner, lo, hi = owner[order], lo[order], hi[order]
    # Offsetting by owner keeps the running maximum of ends from leaking across owners.
    big = int(max(hi.max(), 1)) + 1
    ends = np.maximum.accumulate(hi + owner * big)
    prev = np.concatenate(([-1], ends[:-1]))
    new = (lo + owner * big) > prev
    starts = np.flatnonzero(new)
    stops = np.concatenate((starts[1:], [owner.size])) - 1
    return owner[starts], lo[starts], ends[stops] - owner[stops] * big


def merged_ranges(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray
                  ) -> dict[int, list[tuple[int, int]]]:
    """Per owner, the sorted union of its ``[lo, hi)`` ranges."""
    out: dict[int, list[tuple[int, int]]] = {}
    for o, a, z in zip(*(x.tolist() for x in merged_arrays(owner, lo, hi))):
        out.setdefault(o, []).append((a, z))
    return out


#: Up to this many causal boxes are cut in Python (measured: cheaper than the array levels).
_FEW_CAUSAL = 32

#: Columns of a piece row: the fields of :class:`~cp_core.attention.slices.Piece` in order.
_B, _Q0, _Q1, _SRC, _K0, _K1, _KIND, _DLO, _DHI = range(9)


def _rows_of(pieces: list[Piece]) -> np.ndarray:
    # fromiter over the flat fields: several times faster than asarray over named tuples.
    flat = itertools.chain.from_iterable(pieces)
    return np.fromiter(flat, dtype=np.int64, count=9 * len(pieces)).reshape(-1, 9)


def _full_rows(b: np.ndarray, q0: np.ndarray, q1: np.ndarray, src: np.ndarray, k0: np.ndarray,
               k1: np.ndarray) -> np.ndarray:
    rows = np.empty((b.size, 9), np.int64)
    rows[:, _B], rows[:, _Q0], rows[:, _Q1], rows[:, _SRC] = b, q0, q1, src
    rows[:, _K0], rows[:, _K1] = k0, k1
    rows[:, _KIND], rows[:, _DLO], rows[:, _DHI] = FULL, -INF, INF
    return rows


def _causal_rows(b: np.ndarray, q0: np.ndarray, q1: np.ndarray, src: np.ndarray,
                 k0: np.ndarray, k1: np.ndarray, dhi: np.ndarray) -> list[np.ndarray]:
    """``slices._pieces`` of boxes with only an upper bound (``dlo = -INF``), level by level:
    full keys before the diagonal, the causal square (halved into causal leaves and full
    rectangles until a leaf has at most ``CAUSAL_LEAF`` rows), full rows below it."""
    out = []
    ck = q0 + dhi  # the top row's last key: keys before it are seen by every row
    n = k1 - ck
    pre = ck > k0
    out.append(_full_rows(b[pre], q0[pre], q0[pre] + n[pre], src[pre], k0[pre], ck[pre]))
    below = q0 + n < q1
    out.append(_full_rows(b[below], q0[below] + n[below], q1[below], src[below], k0[below],
                          k1[below]))
    sq = (b, q0, src, ck, n)
    while sq[0].size:
        bb, qq, ss, kk, nn = sq
        leaf = nn <= CAUSAL_LEAF
        rows = _full_rows(bb[leaf], qq[leaf], qq[leaf] + nn[leaf], ss[leaf], kk[leaf],
                          kk[leaf] + nn[leaf])
        rows[:, _KIND] = CAUSAL
        out.append(rows)
        split = ~leaf
        bb, qq, ss, kk, nn = (x[split] for x in (bb, qq, ss, kk, nn))
        h = nn // 2
        out.append(_full_rows(bb, qq + h, qq + nn, ss, kk, kk + h))
        sq = (np.concatenate((bb, bb)), np.concatenate((qq, qq + h)), np.concatenate((ss, ss)),
              np.concatenate((kk, kk + h)), np.concatenate((h, nn - h)))
    return out


def piece_rows(boxes: Boxes) -> np.ndarray:
    """Kernel pieces of the boxes as ``[P, 9]`` rows (:class:`Piece` fields).

    FULL boxes are rows as they are, causal ones are cut with array operations; band boxes
    (two bounds: sliding windows) are cut by ``slices._pieces``.
    """
    full = (boxes.dlo == -INF) & (boxes.dhi == INF)
    causal = (boxes.dlo == -INF) & (boxes.dhi < INF)
    cols = (boxes.b, boxes.q0, boxes.q1, boxes.k_owner, boxes.k0, boxes.k1)
    parts = [_full_rows(*(x[full] for x in cols))]
    # A handful of causal boxes (a head-tail layout's few long documents) is cut faster by
    # the Python recursion than by a dozen array levels; many (a per-document split) by arrays.
    few = int(causal.sum()) <= _FEW_CAUSAL
    if not few:
        parts += _causal_rows(*(x[causal] for x in cols), boxes.dhi[causal])
    cut: list[Piece] = []
    band = ~full if few else ~(full | causal)
    for args in zip(*(x[band].tolist() for x in (*cols, boxes.dlo, boxes.dhi))):
        _pieces(*args, cut)
    if cut:
        parts.append(_rows_of(cut))
    return np.concatenate(parts)


def split_by_src(rows: np.ndarray) -> dict[int, np.ndarray]:
    """Piece rows grouped by their key source, each group in its original order."""
    rows = rows[np.argsort(rows[:, _SRC], kind="stable")]
    owners, first = np.unique(rows[:, _SRC], return_index=True)
    bounds = [*first.tolist(), rows.shape[0]]
    return {int(o): rows[bounds[i]:bounds[i + 1]] for i, o in enumerate(owners.tolist())}


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


def buffer_rows(rows: np.ndarray, owner: np.ndarray, start: np.ndarray, end: np.ndarray
                ) -> np.ndarray:
    """:func:`~cp_core.attention.slices.to_buffer_coords` on piece rows of any sources at
    once: source ``s``'s needed ranges are the ``(owner == s)`` entries, in order."""
    lens = end - start
    # Offset of each range in its owner's buffer: the lengths of that owner's earlier ranges.
    csum = np.cumsum(lens) - lens
    first = np.concatenate(([True], owner[1:] != owner[:-1])) if owner.size else owner
    group_base = np.maximum.accumulate(np.where(first, csum, 0)) if owner.size else csum
    offsets = csum - group_base
    big = int(max(end.max() if end.size else 1, rows[:, _K1].max() if rows.size else 1)) + 1
    i = np.searchsorted(owner * big + start, rows[:, _SRC] * big + rows[:, _K0],
                        side="right") - 1
    shift = offsets[i] - start[i]
    out = rows.copy()
    out[:, _K0] += shift
    out[:, _K1] += shift
    return out


def _as_pieces(rows: np.ndarray) -> list[Piece]:
    new = tuple.__new__
    return [new(Piece, r) for r in rows.tolist()]


def local_pieces(rects: BandRects, q_index: Any, k_index: Any) -> list[Piece]:
    """The pieces of queries at global positions ``q_index`` over keys at ``k_index``, both
    held on this rank (a backend that moved the keys itself): pass A with one key owner."""
    queries = RunTable.of(RankRuns.from_indices(q_index.reshape(1, -1)), [0])
    keys = RunTable.of(RankRuns.from_indices(k_index.reshape(1, -1)), [0])
    return _as_pieces(merge_full_rows(piece_rows(crop(rects, queries, keys))))


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
    r_owner, r_start, r_end = merged_arrays(mine.k_owner, mine.k0, mine.k1)
    rows = piece_rows(mine)
    is_local = rows[:, _SRC] == rank
    local = _as_pieces(merge_full_rows(rows[is_local]))
    # Every source's pieces at once: merged, moved to buffer coordinates (ranges that were
    # apart on the owner sit back to back there), merged again, then split by source.
    remote = merge_full_rows(buffer_rows(merge_full_rows(rows[~is_local]), r_owner, r_start,
                                         r_end))
    by_src = split_by_src(remote)
    recv: dict[int, list[tuple[int, int]]] = {}
    for o, a, z in zip(r_owner.tolist(), r_start.tolist(), r_end.tolist()):
        recv.setdefault(o, []).append((a, z))
    others = [r for r in range(size) if r != rank]
    theirs = crop(rects, RunTable.of(runs, others), me) if others else None
    send = merged_ranges(theirs.q_owner, theirs.k0, theirs.k1) if theirs is not None else {}
    steps = []
    for i in range(1, size):
        src, dst = (rank - i) % size, (rank + i) % size
        ranges = recv.get(src, [])
        pieces = _as_pieces(by_src[src]) if ranges and src in by_src else []
        steps.append((src, ranges, pieces, dst, send.get(dst, [])))
    return local, steps


__all__ = ["RunTable", "Boxes", "crop", "local_pieces", "merged_arrays", "merged_ranges", "piece_rows",
           "split_by_src", "merge_full_rows", "buffer_rows", "schedule_parts"]
