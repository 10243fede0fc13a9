"""The attention mask of one step as a short list of diagonal-band rectangles.

A rectangle ``(b, qs, qe, ks, ke, dlo, dhi)`` says: in batch row ``b`` (``-1``: every row),
global query ``q`` in ``[qs, qe)`` may see global key ``k`` in ``[ks, ke)`` when
``dlo <= k - q <= dhi``. ``dlo = -INF`` / ``dhi = +INF`` switch a bound off. Every mask the
runtime serves is a union of such rectangles that never cover one pair twice:

* a causal document: one rectangle per (query segment, key segment) of the document with
  ``dhi = 0`` (a key never after its query);
* a sliding window of ``w`` tokens adds ``dlo = -(w - 1)``;
* chunked attention splits documents at their chunk boundaries first, then is causal;
* bidirectional documents are full rectangles;
* MagiAttention's rectangle types are the four combinations of the two bounds.

This is the formulation of MagiAttention's ``AttnSlice`` (q range, k range, mask type), with the
type written as two diagonal bounds so that cropping a rectangle to a rank's runs keeps it a
rectangle of the same form. Built from document runs, not tokens: the cost is
O(documents + pad holes).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

#: Sentinel for "no diagonal bound" (far beyond any stream length, far from int64 overflow).
INF: int = 1 << 60


@dataclass(frozen=True)
class BandRects:
    """Non-overlapping band rectangles over a stream (see the module docstring).

    Attributes:
        rows: ``[n, 7]`` int64: ``b, qs, qe, ks, ke, dlo, dhi`` per rectangle.
        batch: the batch size the rectangles address (1 with ``b == -1`` for shared rows).
    """

    rows: np.ndarray
    batch: int

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def allowed_pairs(self) -> int:
        """Number of allowed (query, key) pairs, counted in closed form per rectangle."""
        return int(sum(band_area(*map(int, r[1:])) for r in self.rows))


@runtime_checkable
class RectangleMask(Protocol):
    """A token mask that can describe itself as band rectangles (the runtime's plan input)."""

    def attention_rects(self) -> BandRects:
        """The mask as :class:`BandRects` over the stream its indices address."""
        ...


def kind_bounds(kind: str, window: int | None = None) -> tuple[int, int]:
    """The one mask rule: the diagonal bounds ``dlo <= key - query <= dhi`` of attention
    ``kind`` inside one document (or one chunk of it: chunked attention is causal within
    chunks, see :func:`split_chunks`). Every mask, work count and plan derives from it."""
    if kind == "bidirectional":
        return -INF, INF
    if kind == "sliding_window":
        return -(int(window or 1) - 1), 0
    return -INF, 0  # causal, chunked


def split_chunks(starts: np.ndarray, ends: np.ndarray, chunk: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents ``[starts, ends)`` cut into chunks of ``chunk`` tokens measured from each
    document's first token: ``(chunk starts, chunk ends, owning document index)``."""
    st = np.asarray(starts, dtype=np.int64).reshape(-1)
    en = np.asarray(ends, dtype=np.int64).reshape(-1)
    count = -(-(en - st) // int(chunk))
    owner = np.repeat(np.arange(st.size), count)
    k = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    cs = st[owner] + k * int(chunk)
    return cs, np.minimum(cs + int(chunk), en[owner]), owner


def band_area(qs: int, qe: int, ks: int, ke: int, dlo: int, dhi: int) -> int:
    """Allowed pairs of one rectangle: for every row, the length of its key interval."""
    if dlo > dhi:
        return 0
    total = 0
    # Rows split into at most three stretches where each bound is either clamped or sliding;
    # summing row by row would be O(rows), so sum the arithmetic series per stretch instead.
    q0, q1 = max(qs, ks - dhi), min(qe, ke - dlo)
    if q0 >= q1:
        return 0
    cuts = sorted({q0, q1, min(max(ks - dlo, q0), q1), min(max(ke - 1 - dhi, q0), q1)})
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a >= b:
            continue
        # lo(q) = max(ks, q + dlo), hi(q) = min(ke - 1, q + dhi): linear on [a, b).
        def length(q: int) -> int:
            return min(ke - 1, q + dhi) - max(ks, q + dlo) + 1

        total += (length(a) + length(b - 1)) * (b - a) // 2
    return total


def _value_runs(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, ends)`` of the runs of equal values in a 1-D array."""
    change = np.flatnonzero(row[1:] != row[:-1]) + 1
    return np.concatenate(([0], change)), np.concatenate((change, [row.size]))


def _segments(ids_row: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, doc)`` runs of equal non-zero document ids in one row."""
    if ids_row.size == 0:
        return []
    starts, ends = _value_runs(ids_row)
    docs = ids_row[starts]
    keep = docs > 0
    return list(zip(starts[keep].tolist(), ends[keep].tolist(), docs[keep].tolist()))


def _split_chunks(segs: list[tuple[int, int, int]], first: dict[int, int], chunk: int
                  ) -> list[tuple[int, int, tuple[int, int]]]:
    """Segments cut at every chunk boundary of their document; the key becomes (doc, chunk)."""
    out = []
    for s, e, d in segs:
        f = first[d]
        while s < e:
            c = (s - f) // chunk
            end = min(e, f + (c + 1) * chunk)
            out.append((s, end, (d, c)))
            s = end
    return out


def document_rects(doc_ids: torch.Tensor, kind: str, window: int | None = None,
                   chunk: int | None = None) -> BandRects:
    """Band rectangles of document attention over ``doc_ids [B, S]`` (0 == pad, never seen).

    Positions inside a document are offsets from its first token (pad holes keep counting), so
    causal order, windows and chunks are all measured on the stream index. Rows with equal
    ids share one set of rectangles (``b == -1``).
    """
    ids = doc_ids.detach().to("cpu", torch.int64).numpy()
    bsz = ids.shape[0]
    shared = bsz > 1 and bool((ids == ids[:1]).all())
    rows_to_plan = [0] if (bsz == 1 or shared) else list(range(bsz))
    out: list[tuple[int, ...]] = []
    dlo, dhi = kind_bounds(kind, window)  # chunked: chunks become sub-documents below
    for b in rows_to_plan:
        tag = -1 if (bsz == 1 or shared) else b
        segs = _segments(ids[b])
        first: dict[Any, int] = {}
        for s, _, d in segs:
            first.setdefault(d, s)
        keyed: list[tuple[int, int, Any]] = list(segs)
        if kind == "chunked":
            keyed = _split_chunks(segs, first, int(chunk or 1))
        by_doc: dict[Any, list[tuple[int, int]]] = {}
        for s, e, d in keyed:
            by_doc.setdefault(d, []).append((s, e))
        for parts in by_doc.values():
            for qs, qe in parts:
                for ks, ke in parts:
                    # A key segment wholly after the query segment is never seen (dhi <= 0),
                    # nor one wholly beyond the window.
                    if dhi <= 0 and ks > qe - 1:
                        continue
                    if dlo > -INF and ke - 1 < qs + dlo:
                        continue
                    out.append((tag, qs, qe, ks, ke, dlo, dhi))
    arr = np.asarray(out, dtype=np.int64).reshape(-1, 7)
    return BandRects(arr, 1 if (bsz == 1 or shared) else bsz)


def segment_rects(starts: Any, ends: Any, kind: str, window: int | None = None,
                  chunk: int | None = None, rows: Any = None, batch: int = 1) -> BandRects:
    """The mask of :func:`document_rects` for documents that are each one hole-free segment
    ``[starts[d], ends[d])`` of batch row ``rows[d]`` (None: one stream shared by every row;
    every other position is pad), computed from the segments alone: O(documents), no
    per-token work. Rows with the same segments share one set (``b == -1``), as in
    :func:`document_rects`.
    """
    st = np.asarray(starts, dtype=np.int64).reshape(-1)
    en = np.asarray(ends, dtype=np.int64).reshape(-1)
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        first = rows == rows[0] if rows.size else rows.astype(bool)
        n = int(first.sum())
        if batch == 1 or (n * batch == rows.size
                          and (st.reshape(batch, n) == st[first]).all()
                          and (en.reshape(batch, n) == en[first]).all()):
            st, en, rows, batch = st[first], en[first], None, 1  # every row alike
    rw = np.full(st.size, -1, np.int64) if rows is None else rows
    keep = en > st
    st, en, rw = st[keep], en[keep], rw[keep]
    if kind == "chunked":
        # Every chunk of a document is a document of its own (measured from its first token).
        st, en, owner = split_chunks(st, en, int(chunk or 1))
        rw = rw[owner]
    dlo, dhi = kind_bounds(kind, window)
    out = np.empty((st.size, 7), np.int64)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3], out[:, 4] = rw, st, en, st, en
    out[:, 5], out[:, 6] = dlo, dhi
    return BandRects(out, 1 if rows is None else int(batch))


def real_keys_only(rects: BandRects, real: torch.Tensor) -> BandRects:
    """``rects`` with every key where ``real [S]`` is False removed (a rectangle's key range
    is cut at the pad runs inside it; the band bounds stay, as they are in global positions).
    """
    keep = real.detach().to("cpu", torch.bool).numpy()
    starts, ends = _value_runs(keep) if keep.size else (np.zeros(0, int), np.zeros(0, int))
    runs = [(int(a), int(b)) for a, b in zip(starts, ends) if keep[a]]
    out: list[tuple[int, ...]] = []
    run_starts = [a for a, _ in runs]
    for b, qs, qe, ks, ke, dlo, dhi in rects.rows.tolist():
        i = max(0, bisect.bisect_right(run_starts, ks) - 1)
        while i < len(runs) and runs[i][0] < ke:
            a, e = max(ks, runs[i][0]), min(ke, runs[i][1])
            if a < e:
                out.append((b, qs, qe, a, e, dlo, dhi))
            i += 1
    return BandRects(np.asarray(out, dtype=np.int64).reshape(-1, 7), rects.batch)


__all__ = ["INF", "BandRects", "RectangleMask", "kind_bounds", "split_chunks", "band_area",
           "document_rects", "segment_rects", "real_keys_only"]
