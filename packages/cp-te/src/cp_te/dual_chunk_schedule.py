"""The p2p schedule of the dual-chunk THD layout, in closed form per document.

cp-core builds a rank's schedule for any layout by cropping every mask rectangle to every
pair of runs (:func:`cp_core.plan.crop.schedule_parts`): two passes of binary searches, a
merge of touching pieces with two sorts, a regrouping by source. For this layout with a
causal document mask the answer is known per document, so it is written down directly.

Every document is padded to ``2*cp`` chunks of ``C`` slots and rank ``r`` holds chunks ``r``
(head) and ``2*cp-1-r`` (tail); every rank stores a document's two chunks at the same local
offset ``O`` (head ``[O, O+C)``, tail ``[O+C, O+2C)``), because every rank holds the same
count of every document. With ``m(c)`` the real tokens of chunk ``c`` (those before the
document's length; the rest is pad the mask never reads), query chunk ``a`` sees key chunk
``b`` fully when ``b < a`` and ``m(a) > 0`` (chunk ``b`` is then all real), causally when
``b == a``, and not at all when ``b > a``. Hence, for rank ``r`` and another rank ``s``:

* ``s < r``: the head sees chunk ``s``, the tail sees chunk ``s``: one FULL piece of head and
  tail rows (they touch locally: the tail exists only below a full head) over ``s``'s chunk;
* ``s > r``: only the tail sees chunk ``s`` and chunk ``2*cp-1-s``, which touch in ``s``'s
  storage: one FULL piece over both.

Both patterns are the same for every ``s`` below ``r`` (above ``r``), so two tables per rank
give every ring step. Rank ``cp-1``'s two chunks are consecutive in the stream too, so its
own document is one causal square; every other rank computes head square, tail x head and
tail square (a one-row square is a FULL piece, as the generic builder cuts it). These are
exactly the pieces, ranges and order the generic builder gives (held to it by
``tests/test_dual_chunk_schedule.py``); any other mask (windows, chunked, full, pad holes) or
a rectangle list that is not one causal rectangle per document falls back to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cp_core.backend_api import CAUSAL, FULL, INF

#: One piece in :class:`cp_core.plan.pieces.Piece` field order.
PieceTuple = tuple[int, int, int, int, int, int, int, int, int]
Ranges = list[tuple[int, int]]
Parts = tuple[list[PieceTuple], list[tuple[int, Ranges, list[PieceTuple], int, Ranges]]]


def _exclusive(a: np.ndarray) -> np.ndarray:
    return np.cumsum(a) - a


def _merged(start: np.ndarray, end: np.ndarray) -> Ranges:
    """Ascending ``[start, end)`` ranges with the ones that touch joined."""
    if start.size == 0:
        return []
    new = np.empty(start.size, bool)
    new[0] = True
    np.not_equal(start[1:], end[:-1], out=new[1:])
    first = np.flatnonzero(new)
    last = np.empty_like(first)
    last[:-1] = first[1:] - 1
    last[-1] = start.size - 1
    return list(zip(start[first].tolist(), end[last].tolist()))


def _ranges(start: np.ndarray, end: np.ndarray) -> Ranges:
    """``[start, end)`` ranges known not to touch, as tuples."""
    return list(zip(start.tolist(), end.tolist()))


def _columns(b: int, q0: np.ndarray, q1: np.ndarray, k0: np.ndarray, k1: np.ndarray,
             kind: int = FULL) -> tuple[list[int], ...]:
    """The columns of pieces but their source, as lists (converted once, then zipped with
    each source's number by :func:`_pieces`; ``dlo``/``dhi`` off)."""
    n = q0.size
    return ([b] * n, q0.tolist(), q1.tolist(), k0.tolist(), k1.tolist(), [kind] * n,
            [-INF] * n, [INF] * n)


def _pieces(cols: tuple[list[int], ...], src: int) -> list[PieceTuple]:
    """Plain piece tuples of ``cols`` (see :func:`_columns`) over keys from ``src``."""
    b, q0, q1, k0, k1, kind, dlo, dhi = cols
    return list(zip(b, q0, q1, [src] * len(b), k0, k1, kind, dlo, dhi))


@dataclass(frozen=True)
class DualChunkSchedule:
    """What the closed form needs of a THD stream: per non-empty segment its chunk size, real
    length and first stream slot (host int64 arrays), and the CP size.

    Called as ``builder(rects, rank)`` by :func:`cp_core.plan.schedule.schedule_from_runs`
    (a record, not a closure, so a shard made in a data-loader worker pickles).
    """

    chunk: np.ndarray
    length: np.ndarray
    stream_start: np.ndarray
    cp: int

    def _matches(self, rows: np.ndarray) -> bool:
        """Whether ``rows`` are one causal rectangle per document with real tokens, in
        stream order: the mask this closed form describes."""
        real = self.length > 0
        st = self.stream_start[real]
        if rows.shape[0] != st.size:
            return False
        if st.size == 0:
            return True
        return bool((rows[:, 0] == rows[0, 0]).all() and np.array_equal(rows[:, 1], st)
                    and np.array_equal(rows[:, 2], st + self.length[real])
                    and np.array_equal(rows[:, 3], rows[:, 1])
                    and np.array_equal(rows[:, 4], rows[:, 2])
                    and (rows[:, 5] == -INF).all() and (rows[:, 6] == 0).all())

    def __call__(self, rects: Any, rank: int) -> Parts | None:
        """This rank's local pieces and ring steps, or None when ``rects`` is not the causal
        document mask of this stream (the caller then builds them generically)."""
        rows = rects.rows
        if not self._matches(rows):
            return None
        b = int(rows[0, 0]) if rows.shape[0] else -1
        n, r = self.cp, rank
        c, length = self.chunk, self.length
        off = _exclusive(2 * c)  # local offset of each document's head chunk, on every rank

        # Real tokens of every chunk of every document, [2n, D]: which chunks a rank's
        # queries reach, for this rank and for every peer it sends to.
        fill = np.clip(length - np.arange(2 * n, dtype=np.int64)[:, None] * c, 0, c)
        mh, mt = fill[r], fill[2 * n - 1 - r]
        local = self._local(b, r, off, c, mh, mt)

        # Sources below r: head (and tail, below a full head) rows over chunk s. Two
        # documents' head chunks never touch in storage (a tail lies between), so the ranges
        # need no merging.
        low = mh > 0
        low_len = c[low]
        low_base = _exclusive(low_len)
        low_recv = _ranges(off[low], off[low] + low_len)
        low_cols = _columns(b, off[low], np.where(mt > 0, off + c + mt, off + mh)[low],
                            low_base, low_base + low_len)
        # Sources above r: tail rows over chunks s and 2n-1-s (touching in s's storage).
        up = mt > 0
        up_len = 2 * c[up]
        up_base = _exclusive(up_len)
        up_recv = _merged(off[up], off[up] + up_len)
        up_q0 = (off + c)[up]
        up_cols = _columns(b, up_q0, up_q0 + mt[up], up_base, up_base + up_len)

        steps = []
        for i in range(1, n):
            src, dst = (r - i) % n, (r + i) % n
            ranges, cols = (low_recv, low_cols) if src < r else (up_recv, up_cols)
            pieces = _pieces(cols, src) if ranges else []
            # What dst reads of ours: r is one of its lower or upper sources.
            if r < dst:
                keep = fill[dst] > 0
                send = _ranges(off[keep], (off + c)[keep])
            else:
                keep = fill[2 * n - 1 - dst] > 0
                send = _merged(off[keep], (off + 2 * c)[keep])
            steps.append((src, ranges, pieces, dst, send))
        return local, steps

    def _local(self, b: int, r: int, off: np.ndarray, c: np.ndarray, mh: np.ndarray,
               mt: np.ndarray) -> list[PieceTuple]:
        """Rank ``r``'s pieces over its own keys, as the generic builder orders them: causal
        squares in document order (head before tail), then the FULL pieces by key range.

        A one-row square is a FULL piece there (its only row sees its only key); a one-row
        tail square then joins the tail x head piece of the same rows (their keys touch).
        """
        if r == self.cp - 1:
            # Head and tail are consecutive in the stream: one causal square per document.
            m = mh + mt
            sq, one = m > 1, m == 1
            q0, q1 = off[sq], (off + m)[sq]
            return (_pieces(_columns(b, q0, q1, q0, q1, CAUSAL), r)
                    + _pieces(_columns(b, off[one], off[one] + 1, off[one], off[one] + 1), r))
        q0 = np.stack((off, off + c), axis=1)
        m = np.stack((mh, mt), axis=1)
        sq = m > 1
        causal = _pieces(_columns(b, q0[sq], (q0 + m)[sq], q0[sq], (q0 + m)[sq], CAUSAL), r)
        # FULL pieces per document: the one-row head square, then the tail rows over the
        # head (and over the tail's one key when the tail has one row); both start at the
        # head's first key, the first ending before the second.
        fq0 = q0
        fq1 = q0 + np.stack((np.ones_like(mh), mt), axis=1)
        fk1 = np.stack((off + 1, off + c + (mt == 1)), axis=1)
        keep = np.stack((mh == 1, mt > 0), axis=1)
        k0 = np.stack((off, off), axis=1)[keep]
        return causal + _pieces(_columns(b, fq0[keep], fq1[keep], k0, fk1[keep]), r)


__all__ = ["DualChunkSchedule"]
