"""Attention masks as lists of rectangles, their exact per-row-range area, and a token mask.

A mask over a stream of ``S`` tokens is a list of rectangles ``(q_range, k_range, type)``:
query rows ``[qs, qe)`` may see key rows ``[ks, ke)`` according to ``type`` (MagiAttention's
``AttnMaskType`` semantics, learned from its docs and kernels):

* ``full``         every key of the rectangle;
* ``causal``       the lower triangle aligned to the bottom-right corner: row offset ``r`` sees
                   key offsets ``u <= r + (klen - qlen)``;
* ``inv_causal``   the upper triangle aligned to the top-left corner: ``u >= r``;
* ``bi_causal``    both at once, a band: ``r <= u <= r + (klen - qlen)`` (empty if klen < qlen).

Every row of every type sees one interval of keys, which gives the exact area of any query-row
range in closed form and a cheap per-row interval table for the token mask. Rectangles must
not cover the same (query row, key row) pair twice: attention would count that key twice in a
kernel that sums rectangles, so overlap is refused at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from cp_core.backend_api import INF, BandRects, CPBatchError, CPConfigError

MASK_TYPES: tuple[str, ...] = ("full", "causal", "inv_causal", "bi_causal")
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = range(4)
_ALIASES = {"invcausal": INV_CAUSAL, "bicausal": BI_CAUSAL, "inverse_causal": INV_CAUSAL}


def _type_code(t: int | str) -> int:
    if isinstance(t, (int, np.integer)) and 0 <= int(t) < len(MASK_TYPES):
        return int(t)
    if isinstance(t, str):
        key = t.lower().replace("-", "_")
        if key in MASK_TYPES:
            return MASK_TYPES.index(key)
        if key in _ALIASES:
            return _ALIASES[key]
    raise CPConfigError(f"unknown attention mask type {t!r}; expected one of {list(MASK_TYPES)}")


@dataclass(frozen=True)
class AttnRectangles:
    """A validated rectangle mask over a stream of ``seq_len`` tokens.

    Attributes:
        q_ranges: ``[n, 2]`` int64 query row ranges ``[start, end)``.
        k_ranges: ``[n, 2]`` int64 key row ranges ``[start, end)``.
        types: ``[n]`` int64 codes into :data:`MASK_TYPES`.
        seq_len: length of the stream the ranges index.
    """

    q_ranges: np.ndarray
    k_ranges: np.ndarray
    types: np.ndarray
    seq_len: int
    _table: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_lists(cls, q_ranges: Sequence[Sequence[int]], k_ranges: Sequence[Sequence[int]],
                   types: Sequence[int | str] | np.ndarray, seq_len: int, *,
                   check_overlap: bool = True) -> "AttnRectangles":
        """Build and validate a mask (ranges non-empty, inside the stream, no double cover).
        ``types`` are names or codes of :data:`MASK_TYPES`, or an int array of codes."""
        q = np.asarray(q_ranges, dtype=np.int64).reshape(-1, 2)
        k = np.asarray(k_ranges, dtype=np.int64).reshape(-1, 2)
        if isinstance(types, np.ndarray) and np.issubdtype(types.dtype, np.integer):
            # Codes already: one range check instead of a Python call per rectangle.
            t = types.astype(np.int64).reshape(-1)
            bad = np.nonzero((t < 0) | (t >= len(MASK_TYPES)))[0]
            if bad.size:
                _type_code(int(t[bad[0]]))  # raises with the usual message
        else:
            t = np.asarray([_type_code(x) for x in types], dtype=np.int64)
        if not (len(q) == len(k) == len(t)):
            raise CPBatchError(
                f"mask has {len(q)} q_ranges, {len(k)} k_ranges and {len(t)} types; expected "
                "one of each per rectangle"
            )
        out = cls(q, k, t, int(seq_len))
        out.validate(check_overlap=check_overlap)
        return out

    def __len__(self) -> int:
        return int(self.types.shape[0])

    # -- validation ------------------------------------------------------------------------

    def validate(self, *, check_overlap: bool = True) -> None:
        """Raise :class:`CPBatchError` for empty or out-of-stream ranges, or for rectangles
        covering one (query row, key row) pair twice."""
        for name, r in (("q_ranges", self.q_ranges), ("k_ranges", self.k_ranges)):
            empty = np.nonzero(r[:, 1] <= r[:, 0])[0]
            if empty.size:
                i = int(empty[0])
                raise CPBatchError(
                    f"mask rectangle {i} has an empty {name[0]}_range [{r[i, 0]}, {r[i, 1]}); "
                    "every range must satisfy start < end"
                )
            bad = np.nonzero((r[:, 0] < 0) | (r[:, 1] > self.seq_len))[0]
            if bad.size:
                i = int(bad[0])
                raise CPBatchError(
                    f"mask rectangle {i} has {name[0]}_range [{r[i, 0]}, {r[i, 1]}) outside the "
                    f"stream [0, {self.seq_len})"
                )
        if check_overlap:
            pair = self.find_overlap()
            if pair is not None:
                i, j, row, key = pair
                raise CPBatchError(
                    f"mask rectangles {i} ({self.describe(i)}) and {j} ({self.describe(j)}) both "
                    f"cover query row {row} and key row {key}; each (query, key) pair may be "
                    "covered by at most one rectangle"
                )

    def describe(self, i: int) -> str:
        """``q=[a, b) k=[c, d) type`` of rectangle ``i``."""
        q, k = self.q_ranges[i], self.k_ranges[i]
        return f"q=[{q[0]}, {q[1]}) k=[{k[0]}, {k[1]}) {MASK_TYPES[int(self.types[i])]}"

    def row_intervals(self, rows: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inclusive key interval ``[lo, hi]`` seen by global query ``rows`` in rectangles
        ``idx`` (same length); ``lo > hi`` where the row sees nothing."""
        qs, ks, ke = self.q_ranges[idx, 0], self.k_ranges[idx, 0], self.k_ranges[idx, 1]
        t = self.types[idx]
        r = rows - qs
        delta = (ke - ks) - (self.q_ranges[idx, 1] - qs)
        lo = np.where((t == INV_CAUSAL) | (t == BI_CAUSAL), ks + r, ks)
        hi = np.where((t == CAUSAL) | (t == BI_CAUSAL), ks + r + delta, ke - 1)
        return np.maximum(lo, ks), np.minimum(hi, ke - 1)

    def find_overlap(self) -> tuple[int, int, int, int] | None:
        """First ``(i, j, query_row, key_row)`` covered by two rectangles, or None."""
        n = len(self)
        if n < 2:
            return None
        # Candidate pairs: query ranges intersect (sweep over rectangles sorted by start).
        order = np.lexsort((np.arange(n), self.q_ranges[:, 0]))
        qs, qe = self.q_ranges[order, 0], self.q_ranges[order, 1]
        stop = np.searchsorted(qs, qe, side="left")
        counts = np.maximum(stop - np.arange(1, n + 1), 0)
        if counts.sum() == 0:
            return None
        a = np.repeat(np.arange(n), counts)
        b = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + a + 1
        i, j = order[a], order[b]
        k_hit = (np.maximum(self.k_ranges[i, 0], self.k_ranges[j, 0])
                 < np.minimum(self.k_ranges[i, 1], self.k_ranges[j, 1]))
        for x, y in zip(i[k_hit].tolist(), j[k_hit].tolist()):
            lo_q = max(self.q_ranges[x, 0], self.q_ranges[y, 0])
            hi_q = min(self.q_ranges[x, 1], self.q_ranges[y, 1])
            rows = np.arange(lo_q, hi_q, dtype=np.int64)
            lx, hx = self.row_intervals(rows, np.full(rows.shape, x))
            ly, hy = self.row_intervals(rows, np.full(rows.shape, y))
            lo, hi = np.maximum(lx, ly), np.minimum(hx, hy)
            hit = np.nonzero(lo <= hi)[0]
            if hit.size:
                first = int(hit[0])
                return (min(x, y), max(x, y), int(rows[first]), int(lo[first]))
        return None

    # -- area ------------------------------------------------------------------------------

    def prefix_area(self, x: np.ndarray) -> np.ndarray:
        """Exact mask area of query rows ``[0, x)`` for every ``x`` (int64, closed form)."""
        x = np.asarray(x, dtype=np.int64)
        out = np.zeros(x.shape, dtype=np.int64)
        n = len(self)
        if n == 0:
            return out
        # Bound memory of the [len(x), n] broadcast by processing rectangles in blocks.
        step = max(1, (1 << 22) // max(1, x.size))
        for s in range(0, n, step):
            out += self._prefix_block(x, slice(s, s + step)).sum(axis=1)
        return out

    def _prefix_block(self, x: np.ndarray, sl: slice) -> np.ndarray:
        qs, qe = self.q_ranges[sl, 0], self.q_ranges[sl, 1]
        klen = self.k_ranges[sl, 1] - self.k_ranges[sl, 0]
        qlen = qe - qs
        t = self.types[sl]
        rows = np.clip(x.reshape(-1, 1) - qs, 0, qlen)  # rows of the rectangle below x
        # A block of one kind (every document-causal mask: all causal) needs only its own
        # formula: each is a few passes over the [len(x), rectangles] grid.
        one = int(t[0]) if t.size and (t == t[0]).all() else None
        c = klen - qlen + 1
        parts = []
        for kind in (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL):
            if one is not None and kind != one:
                continue
            if kind == FULL:
                part = rows * klen
            elif kind == CAUSAL:
                # causal: row r sees max(0, r + c) keys, c = klen - qlen + 1.
                first = np.maximum(0, -c)
                m = np.maximum(0, rows - first)
                part = m * (first + c) + m * (m - 1) // 2
            elif kind == INV_CAUSAL:
                # inv_causal: row r sees klen - r keys (r < qlen <= ... clipped at 0).
                mi = np.minimum(rows, klen)
                part = mi * klen - mi * (mi - 1) // 2
            else:
                part = rows * np.maximum(0, c)  # bi-causal
            if one is not None:
                return part
            parts.append(part)
        return np.select([t == FULL, t == CAUSAL, t == INV_CAUSAL], parts[:3], parts[3])

    def range_area(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Exact mask area of query rows ``[starts[i], ends[i])`` for each ``i``."""
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        both = self.prefix_area(np.concatenate([starts, ends]))
        return both[starts.size:] - both[:starts.size]

    def chunk_workloads(self, chunk_size: int) -> np.ndarray:
        """Area of every chunk of ``chunk_size`` query rows; the stream must divide evenly."""
        if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise CPConfigError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if self.seq_len % chunk_size:
            raise CPBatchError(
                f"chunk_size={chunk_size} does not divide the stream length {self.seq_len}; "
                f"pad the stream to a multiple of {chunk_size} first"
            )
        bounds = self.prefix_area(np.arange(0, self.seq_len + 1, chunk_size, dtype=np.int64))
        return np.diff(bounds)

    def total_area(self) -> int:
        """Area of the whole mask."""
        return int(self.prefix_area(np.asarray([self.seq_len]))[0])

    # -- token mask ------------------------------------------------------------------------

    def interval_table(self) -> tuple[np.ndarray, np.ndarray]:
        """``[seq_len, depth]`` inclusive key intervals per query row (``lo > hi`` = unused),
        depth being the most rectangles covering one query row. Built once and cached."""
        if "lo" not in self._table:
            cover = np.zeros(self.seq_len + 1, dtype=np.int64)
            np.add.at(cover, self.q_ranges[:, 0], 1)
            np.add.at(cover, self.q_ranges[:, 1], -1)
            depth = max(1, int(np.cumsum(cover).max()) if len(self) else 1)
            lo = np.ones((self.seq_len, depth), dtype=np.int64)
            hi = np.zeros((self.seq_len, depth), dtype=np.int64)
            used = np.zeros(self.seq_len, dtype=np.int64)
            order = np.lexsort((np.arange(len(self)), self.q_ranges[:, 0]))
            for i in order.tolist():
                a, b = int(self.q_ranges[i, 0]), int(self.q_ranges[i, 1])
                rows = np.arange(a, b, dtype=np.int64)
                slot = used[a:b]
                lo_i, hi_i = self.row_intervals(rows, np.full(rows.shape, i))
                lo[rows, slot] = lo_i
                hi[rows, slot] = hi_i
                used[a:b] += 1
            self._table["lo"], self._table["hi"] = lo, hi
        return self._table["lo"], self._table["hi"]


@dataclass(frozen=True)
class RectangleTokenMask:
    """A cp-core ``TokenMask`` over a rectangle mask: ``block(q, k) -> bool [1, nq, nk]``.

    Built on the per-row key intervals, so one call costs ``depth * nq * nk`` comparisons
    (depth = most rectangles over one query row, 1 for document-causal masks).
    """

    rects: AttnRectangles
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    """Per query row, the inclusive key intervals (None until :meth:`block` first needs them:
    the p2p runtime reads :meth:`attention_rects` only, and building the table is O(S))."""
    window: int | None = None
    """The sliding window the rectangles were built with (None: none, or not known)."""
    chunk: int | None = None
    """The chunk of chunked attention the rectangles were built with (None: none/unknown)."""
    derive: Callable[[str, int | None, int | None], "RectangleTokenMask"] | None = field(
        default=None, compare=False, repr=False)
    """``(kind, window, chunk) -> mask`` of the same documents with another attention kind
    (set when the rectangles were built from the step's documents; None: they cannot be)."""
    table_device: Any = field(default=None, compare=False, repr=False)
    """Where the interval table is built when it is first needed."""

    @classmethod
    def from_rectangles(cls, rects: AttnRectangles, device: torch.device | str | None = None,
                        window: int | None = None, chunk: int | None = None,
                        derive: Callable[[str, int | None, int | None], "RectangleTokenMask"]
                        | None = None) -> "RectangleTokenMask":
        """Precompute the interval table of ``rects`` on ``device``; ``window`` / ``chunk``
        record the kind they were built for, so a model call can be checked against it;
        ``derive`` rebuilds the mask for another kind (see :meth:`for_kind`)."""
        return cls(rects, None, None, window, chunk, derive, device)

    def _intervals(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lo is None or self.hi is None:
            lo, hi = self.rects.interval_table()
            # A cache on a frozen record: the table is a pure function of the rectangles.
            object.__setattr__(self, "lo", torch.from_numpy(lo).to(self.table_device))
            object.__setattr__(self, "hi", torch.from_numpy(hi).to(self.table_device))
        assert self.lo is not None and self.hi is not None
        return self.lo, self.hi

    def for_kind(self, kind: str, window: int | None = None, chunk: int | None = None
                 ) -> "RectangleTokenMask | None":
        """The same documents' mask with attention ``kind`` (a model layer of another kind,
        e.g. Gemma 3's full layers under a sliding-window config); None when the rectangles
        are not built from documents (a caller's own rectangles, a shared prefix)."""
        return None if self.derive is None else self.derive(kind, window, chunk)

    def block(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Bool ``[1, len(q_index), len(k_index)]``: True where the query sees the key."""
        lo_all, hi_all = self._intervals()
        lo = lo_all.to(q_index.device).index_select(0, q_index)  # [nq, depth]
        hi = hi_all.to(q_index.device).index_select(0, q_index)
        k = k_index.view(1, -1)
        # One [nq, nk] comparison per slot keeps memory at one mask, whatever the depth.
        allowed = (k >= lo[:, :1]) & (k <= hi[:, :1])
        for d in range(1, lo.shape[1]):
            allowed |= (k >= lo[:, d:d + 1]) & (k <= hi[:, d:d + 1])
        return allowed.unsqueeze(0)

    def attention_rects(self) -> BandRects:
        """The rectangles as cp-core band rectangles over the flat stream (the runtime's plan).

        ``causal`` (bottom-right aligned) bounds ``k - q <= ke - qe``; ``inv_causal`` bounds
        ``k - q >= ks - qs``; ``bi_causal`` both; ``full`` neither.
        """
        r = self.rects
        n = len(r)
        out = np.empty((n, 7), dtype=np.int64)
        out[:, 0] = -1
        out[:, 1:3], out[:, 3:5] = r.q_ranges, r.k_ranges
        upper = (r.types == CAUSAL) | (r.types == BI_CAUSAL)
        lower = (r.types == INV_CAUSAL) | (r.types == BI_CAUSAL)
        out[:, 5] = np.where(lower, r.k_ranges[:, 0] - r.q_ranges[:, 0], -INF)
        out[:, 6] = np.where(upper, r.k_ranges[:, 1] - r.q_ranges[:, 1], INF)
        return BandRects(out, 1)


__all__ = ["MASK_TYPES", "AttnRectangles", "RectangleTokenMask"]
