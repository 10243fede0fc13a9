"""The p2p schedule from runs, vectorised: rectangles cropped to rank runs with numpy.

:func:`cp_core.testing.reference_plan.build_rank_slices` crops one (rectangle, query run, key run)
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

from cp_core.plan.crop_few import few_passes
from cp_core.plan.rects import INF, BandRects
from cp_core.plan.run_table import RunTable, overlaps
from cp_core.plan.pieces import (
    CAUSAL,
    FULL,
    Piece,
    _pieces,
    merge_full_pieces,
    to_buffer_coords,
)
from cp_core.placement.runs import RankRuns


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
    return _crop_rows(rects.rows, queries, keys)


def _crop_rows(rows: np.ndarray, queries: RunTable, keys: RunTable) -> Boxes:
    item, qr = overlaps(rows[:, 1], rows[:, 2], queries)
    b, qs, qe, ks, ke, dlo, dhi = rows[item].T  # one gather of every column
    a = np.maximum(qs, queries.start[qr])
    e = np.minimum(qe, queries.end[qr])
    # Keys this query range can reach at all, so runs outside the band are never visited.
    lo_k = np.where(dlo > -INF, np.maximum(ks, a + dlo), ks)
    hi_k = np.where(dhi < INF, np.minimum(ke, e + dhi), ke)
    item2, kr = overlaps(lo_k, hi_k, keys)
    b, a, e, dlo, dhi, qr = (x[item2] for x in (b, a, e, dlo, dhi, qr))
    c = np.maximum(lo_k[item2], keys.start[kr])
    f = np.minimum(hi_k[item2], keys.end[kr])
    # Tighten: the smallest box of the band with every row and key used.
    q0 = np.maximum(a, c - dhi)
    q1 = np.minimum(e, f - dlo)
    k0 = np.maximum(c, q0 + dlo)
    k1 = np.minimum(f, q1 + dhi)
    keep = (dlo <= dhi) & (c < f) & (q0 < q1) & (k0 < k1)
    if not keep.all():  # usually every crop is kept: no nine selections then
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
    return ranges_by_owner(*merged_arrays(owner, lo, hi))


def ranges_by_owner(owner: np.ndarray, start: np.ndarray, end: np.ndarray
                    ) -> dict[int, list[tuple[int, int]]]:
    """``{owner: [(start, end), ...]}`` of arrays sorted by owner (tuples built by ``zip`` in
    C: a per-document split has thousands of ranges)."""
    if owner.size == 0:
        return {}
    cut = np.flatnonzero(owner[1:] != owner[:-1]) + 1
    bounds = [0, *cut.tolist(), owner.size]
    pairs = list(zip(start.tolist(), end.tolist()))
    firsts = owner[bounds[:-1]].tolist()
    return {o: pairs[a:b] for o, a, b in zip(firsts, bounds[:-1], bounds[1:])}


def merged_ranges_few(owner: np.ndarray, lo: np.ndarray, hi: np.ndarray
                      ) -> dict[int, list[tuple[int, int]]]:
    """:func:`merged_ranges` in Python, for a handful of ranges (a head-tail layout's crops):
    below a few dozen, one sort of tuples costs less than numpy's dozen array calls."""
    return merged_triples(zip(owner.tolist(), lo.tolist(), hi.tolist()))


def merged_triples(triples: Any) -> dict[int, list[tuple[int, int]]]:
    """:func:`merged_ranges_few` of ``(owner, lo, hi)`` triples."""
    out: dict[int, list[tuple[int, int]]] = {}
    # Sorted by (owner, start): owners come out ascending, as ranges_by_owner gives them;
    # ties in start order by end, which leaves each union unchanged.
    for o, a, b in sorted(triples):
        got = out.get(o)
        if got is None:
            out[o] = [(a, b)]
        elif a <= got[-1][1]:  # overlaps or touches the union so far: extend it
            if b > got[-1][1]:
                got[-1] = (got[-1][0], b)
        else:
            got.append((a, b))
    return out


Ranges = list[tuple[int, int]]  # ``[start, end)`` key ranges, ascending
#: Columns of a piece row: the fields of :class:`~cp_core.plan.pieces.Piece` in order.
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
    """``slices._pieces`` of boxes with only an upper bound (``dlo = -INF``): full keys before
    the diagonal, the causal square (one piece: the kernel tiles it), full rows below it."""
    ck = q0 + dhi  # the top row's last key: keys before it are seen by every row
    n = k1 - ck
    pre = ck > k0
    below = q0 + n < q1
    square = _full_rows(b, q0, q0 + n, src, ck, k1)
    square[:, _KIND] = CAUSAL
    return [_full_rows(b[pre], q0[pre], q0[pre] + n[pre], src[pre], k0[pre], ck[pre]), square,
            _full_rows(b[below], q0[below] + n[below], q1[below], src[below], k0[below],
                       k1[below])]


def piece_rows(boxes: Boxes) -> np.ndarray:
    """Kernel pieces of the boxes as ``[P, 9]`` rows (:class:`Piece` fields).

    FULL and causal boxes with array operations (a causal square stays one piece); band boxes
    (two bounds: sliding windows) are cut into tiles by ``slices._pieces``.
    """
    full = (boxes.dlo == -INF) & (boxes.dhi == INF)
    causal = (boxes.dlo == -INF) & (boxes.dhi < INF)
    cols = (boxes.b, boxes.q0, boxes.q1, boxes.k_owner, boxes.k0, boxes.k1)
    parts = [_full_rows(*(x[full] for x in cols))]
    parts += _causal_rows(*(x[causal] for x in cols), boxes.dhi[causal])
    band = ~(full | causal)
    if band.any():
        cut: list[Piece] = []
        for args in zip(*(x[band].tolist() for x in (*cols, boxes.dlo, boxes.dhi))):
            _pieces(*args, cut)
        if cut:
            parts.append(_rows_of(cut))
    return np.concatenate(parts)


def pieces_by_src(rows: np.ndarray) -> dict[int, list[Piece]]:
    """Piece rows grouped by their key source (each group in its original order), as piece
    tuples: one conversion for all sources, then cut."""
    rows = rows[np.argsort(rows[:, _SRC], kind="stable")]
    src = rows[:, _SRC]
    cuts = (np.flatnonzero(src[1:] != src[:-1]) + 1).tolist()
    pieces = _as_pieces(rows)
    bounds = [0, *cuts, len(pieces)]
    return {int(src[a]): pieces[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a}


def _merge_runs(rows: np.ndarray, same: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """FULL rows with equal ``same`` columns whose ``[lo, hi)`` touch, merged (one pass of
    :func:`~cp_core.plan.pieces.merge_full_pieces`)."""
    if rows.shape[0] < 2:
        return rows
    rows = rows[np.lexsort(tuple(rows[:, c] for c in (lo, *reversed(same))))]
    # One comparison of whole neighbouring rows, then the ``same`` columns of it: a few
    # array calls instead of three per column.
    cont = ~(rows[1:] != rows[:-1])[:, same].any(axis=1)
    cont &= rows[1:, lo] == rows[:-1, hi]
    start = np.concatenate(([True], ~cont))
    out = rows[start]
    # A chain of touching ranges ends with its largest end: its last row's.
    out[:, hi] = rows[np.concatenate((start[1:], [True])), hi]
    return out


def merge_full_rows(rows: np.ndarray) -> np.ndarray:
    """:func:`~cp_core.plan.pieces.merge_full_pieces` on piece rows, vectorised."""
    full = rows[:, _KIND] == FULL
    merged = _merge_runs(rows[full], (_B, _SRC, _Q0, _Q1), _K0, _K1)
    merged = _merge_runs(merged, (_B, _SRC, _K0, _K1), _Q0, _Q1)
    return np.concatenate((rows[~full], merged))


def buffer_rows(rows: np.ndarray, owner: np.ndarray, start: np.ndarray, end: np.ndarray,
                keep: int | None = None) -> np.ndarray:
    """:func:`~cp_core.plan.pieces.to_buffer_coords` on piece rows of any sources at
    once: source ``s``'s needed ranges are the ``(owner == s)`` entries, in order. Rows of
    source ``keep`` (this rank's own keys, read in place) are left as they are."""
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
    if keep is not None:
        shift[rows[:, _SRC] == keep] = 0
    out = rows.copy()
    out[:, _K0] += shift
    out[:, _K1] += shift
    return out


def _as_pieces(rows: np.ndarray) -> list[Piece]:
    # Plain tuples in Piece's field order, zipped from column lists in C: a tuple subclass
    # would cost a second allocation per piece (and, unlike plain int tuples, stay tracked
    # by the garbage collector). Consumers read pieces by position, or wrap with Piece._make.
    return list(zip(*rows.T.tolist()))  # type: ignore[arg-type]


def local_pieces(rects: BandRects, q_index: Any, k_index: Any) -> list[Piece]:
    """The pieces of queries at global positions ``q_index`` over keys at ``k_index``, both
    held on this rank (a backend that moved the keys itself): pass A with one key owner."""
    queries = RunTable.of(RankRuns.from_indices(q_index.reshape(1, -1)), [0])
    keys = RunTable.of(RankRuns.from_indices(k_index.reshape(1, -1)), [0])
    return _as_pieces(merge_full_rows(piece_rows(crop(rects, queries, keys))))


def _both_passes(rects: BandRects, runs: RankRuns, rank: int
                 ) -> tuple[Boxes, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Pass A's boxes (this rank's queries x every rank's keys) and pass B's ``(query owner,
    k0, k1)`` (every other rank's queries x this rank's keys) from one crop.

    Pass B's rectangles and runs are shifted past every position of pass A, so no crop mixes
    the two passes; local rows and band bounds are differences, which the shift leaves alone.
    One crop over both costs half the array calls of two (the calls, not the elements,
    dominate at a few hundred rectangles).
    """
    key = ("both_passes", rank)
    tables = runs.cache.get(key)
    rows = rects.rows
    if tables is None:
        me, everyone, others = RunTable.split(runs, rank)
        off = int(max(everyone.end.max(initial=0), rows[:, 1:5].max(initial=0))) + 1

        def cat(a: RunTable, b: RunTable) -> RunTable:
            return RunTable(*(np.concatenate((x, y + sh)) for x, y, sh in (
                (a.start, b.start, off), (a.end, b.end, off), (a.local, b.local, 0),
                (a.owner, b.owner, 0))))

        tables = runs.cache[key] = (cat(me, others), cat(everyone, me), off)
    queries, keys, off = tables
    if rows.size and int(rows[:, 1:5].max()) >= off:  # rectangles beyond every run: unshared
        runs.cache.pop(key)
        return _both_passes(rects, runs, rank)
    shifted = rows.copy()
    shifted[:, 1:5] += off
    boxes = _crop_rows(np.concatenate((rows, shifted)), queries, keys)
    # Crops come out in rectangle order, so pass A's (the first copy's) come first: a cut,
    # not a selection.
    n = int(np.count_nonzero(boxes.q_owner == rank))
    mine = Boxes(*(x[:n] for x in (boxes.b, boxes.q_owner, boxes.k_owner, boxes.q0, boxes.q1,
                                   boxes.k0, boxes.k1, boxes.dlo, boxes.dhi)))
    return mine, (boxes.q_owner[n:], boxes.k0[n:], boxes.k1[n:])


#: Up to this many crops, pieces are cut and merged by the Python definitions of
#: :mod:`cp_core.plan.pieces`: below that numpy's per-call overhead costs more than the
#: loop (a head-tail layout has about a dozen crops per rank).
_FEW_BOXES = 64


def _few_pieces(mine: Boxes, rank: int, recv: dict[int, list[tuple[int, int]]]
                ) -> tuple[list[Piece], dict[int, list[Piece]]]:
    """:func:`_many_pieces` for a handful of boxes, in Python."""
    cols = (mine.b, mine.q0, mine.q1, mine.k_owner, mine.k0, mine.k1, mine.dlo, mine.dhi)
    return _pieces_of_boxes(zip(*(x.tolist() for x in cols)), rank, recv)


def _pieces_of_boxes(boxes: Any, rank: int, recv: dict[int, list[tuple[int, int]]]
                     ) -> tuple[list[Piece], dict[int, list[Piece]]]:
    """Local pieces and per source the pieces in buffer coordinates, of boxes given as
    ``(b, q0, q1, src, k0, k1, dlo, dhi)`` tuples."""
    by: dict[int, list[Piece]] = {}
    for args in boxes:
        _pieces(*args, by.setdefault(args[3], []))
    local = merge_full_pieces(by.pop(rank, []))
    return local, {s: merge_full_pieces(to_buffer_coords(ps, recv[s])) for s, ps in by.items()}


def _many_pieces(mine: Boxes, rank: int, r_owner: np.ndarray, r_start: np.ndarray,
                 r_end: np.ndarray) -> tuple[list[Piece], dict[int, list[Piece]]]:
    """This rank's local pieces, and per source its pieces in receive-buffer coordinates."""
    rows = piece_rows(mine)
    # Remote pieces are merged in buffer coordinates only: ranges that touch on the owner
    # touch in the buffer too, and ranges that were apart there sit back to back. Local and
    # remote rows are merged, sorted and converted in one pass each: the merge keys and the
    # grouping include the source, so no row of one ever joins or reorders the other.
    merged = merge_full_rows(buffer_rows(rows, r_owner, r_start, r_end, keep=rank))
    by_src = pieces_by_src(merged)
    return by_src.pop(rank, []), by_src


def schedule_parts(rects: BandRects, runs: RankRuns, rank: int
                   ) -> tuple[list[Piece], list[tuple[int, list[tuple[int, int]], list[Piece], int,
                                                    list[tuple[int, int]]]]]:
    """This rank's local pieces and, per ring step ``i``, ``(src, recv ranges, pieces in
    buffer coordinates, dst, send ranges)`` — what :class:`~cp_core.runtime.p2p_ring.RingStep`
    holds."""
    size = runs.size
    few = few_passes(rects.rows, runs, rank)
    if few is not None:
        boxes, sent = few
        recv = merged_triples((box[3], box[4], box[5]) for box in boxes)
        local, by_src = _pieces_of_boxes(boxes, rank, recv)
        return local, ring_steps(rank, size, recv, by_src, merged_triples(sent))
    mine, theirs = _both_passes(rects, runs, rank)
    if mine.b.size <= _FEW_BOXES:
        recv = merged_ranges_few(mine.k_owner, mine.k0, mine.k1)
        local, by_src = _few_pieces(mine, rank, recv)
    else:
        r_owner, r_start, r_end = merged_arrays(mine.k_owner, mine.k0, mine.k1)
        recv = ranges_by_owner(r_owner, r_start, r_end)
        local, by_src = _many_pieces(mine, rank, r_owner, r_start, r_end)
    send = merged_ranges_few(*theirs) if theirs[0].size <= _FEW_BOXES else \
        merged_ranges(*theirs)
    return local, ring_steps(rank, size, recv, by_src, send)


def ring_steps(rank: int, size: int, recv: dict[int, Ranges], by_src: dict[int, list[Piece]],
               send: dict[int, Ranges]) -> list[tuple[int, Ranges, list[Piece], int, Ranges]]:
    """Per ring step ``i``: ``(src, recv ranges, pieces, dst, send ranges)`` from the ranges
    received per source, the pieces per source in buffer coordinates and the ranges sent per
    peer: the steps of :func:`schedule_parts`, which a closed-form builder returns too."""
    steps = []
    for i in range(1, size):
        src, dst = (rank - i) % size, (rank + i) % size
        ranges = recv.get(src, [])
        steps.append((src, ranges, by_src.get(src, []) if ranges else [], dst,
                      send.get(dst, [])))
    return steps


__all__ = ["Boxes", "crop", "local_pieces", "merged_arrays", "merged_ranges",
           "merged_ranges_few", "merged_triples", "ranges_by_owner", "piece_rows",
           "pieces_by_src", "merge_full_rows", "buffer_rows", "schedule_parts", "ring_steps"]
