"""Kernel pieces: the step's band rectangles cropped to what a rank holds, cut for fused kernels.

A rank's queries and every rank's keys are runs of consecutive global positions (a head-tail
layout has two per rank, a per-document split two per document, a chunk dispatch one per
chunk). Cropping each rectangle to (query run x key run) gives the slices one rank computes;
each slice is then tightened to the rows and keys it really uses and cut into kernel pieces
that a fused attention kernel computes exactly:

* ``FULL``: every query of the piece sees every key;
* ``CAUSAL``: a square, query ``i`` sees keys ``0..i`` (top-left aligned, as
  ``scaled_dot_product_attention(is_causal=True)`` on a square);
* ``BAND``: a tile of at most a few window widths with an explicit additive mask
  ``dlo <= u - r <= dhi`` (sliding windows, MagiAttention's inverse-causal types).

Every row of every piece has at least one allowed key, so no kernel ever sees an empty row
(CPU flash attention returns a log-sum-exp of 0 for one, which would corrupt the merge).
Everything here is plain Python integers computed on the host before the forward: the kernels
and the communication only consume ranges.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple


from cp_core.placement.runs import Run, index_runs
from cp_core.plan.rects import INF, band_area

#: Piece kind: every query row sees every key row.
FULL: int = 0
#: Piece kind: a top-left causal square (row ``i`` sees keys ``0..i``).
CAUSAL: int = 1
#: Piece kind: a band tile with explicit bounds ``dlo <= u - r <= dhi``.
BAND: int = 2
PIECE_KINDS: tuple[str, ...] = ("full", "causal", "band")


class Piece(NamedTuple):
    """One kernel call: local query rows ``[q0, q1)`` of batch row ``b`` (-1: all rows) against
    key rows ``[k0, k1)`` of the key source (``src``'s local rows, or a receive buffer's), with
    ``kind`` and, for ``BAND``, the bounds ``dlo <= u - r <= dhi`` in piece coordinates.

    A named tuple: a long-context step has thousands of pieces, built on the host every step.
    Schedules built with arrays (:mod:`cp_core.plan.crop`) hold plain tuples in this
    field order instead (half the cost to create); ``Piece._make(t)`` names one.
    """

    b: int
    q0: int
    q1: int
    src: int
    k0: int
    k1: int
    kind: int
    dlo: int = -INF
    dhi: int = INF

    @property
    def area(self) -> int:
        """Score elements the kernel computes (a causal square counts its triangle)."""
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        if self.kind == CAUSAL:
            return nq * (nq + 1) // 2
        return nq * nk

    @property
    def pairs(self) -> int:
        """Allowed (query, key) pairs of the piece."""
        if self.kind == BAND:
            return band_area(0, self.q1 - self.q0, 0, self.k1 - self.k0, self.dlo, self.dhi)
        return self.area


def _tighten(qs: int, qe: int, ks: int, ke: int, dlo: int, dhi: int
             ) -> tuple[int, int, int, int, int, int] | None:
    """The smallest box of the same band with every row and key used; inactive bounds off."""
    if dlo > dhi:
        return None
    qs, qe = max(qs, ks - dhi), min(qe, ke - dlo)
    if qs >= qe:
        return None
    ks, ke = max(ks, qs + dlo), min(ke, qe + dhi)
    if ks >= ke:
        return None
    if qs + dhi >= ke - 1:
        dhi = INF  # even the first row sees the last key
    if qe - 1 + dlo <= ks:
        dlo = -INF  # even the last row sees the first key
    return qs, qe, ks, ke, dlo, dhi


def _band_tile_rows(dlo: int, dhi: int) -> int:
    """Query rows per band tile: a tile of ``T`` rows spans ``T + width - 1`` keys, so
    ``T = width / 4`` keeps the computed area within 1.25x of the allowed pairs."""
    width = dhi - dlo + 1 if dlo > -INF and dhi < INF else 64
    return max(16, width // 4)


def _causal(b: int, q0: int, src: int, k0: int, n: int, out: list[Piece]) -> None:
    """A top-left causal square of ``n`` rows: one piece, whatever its size. How a kernel
    tiles the diagonal is the kernel's business (:func:`cp_core.runtime.kernels.fused.kernel_calls`),
    so the host plan stays O(rectangles x runs) and never grows with document length."""
    out.append(Piece(b, q0, q0 + n, src, k0, k0 + n, CAUSAL))


def _pieces(b: int, qs: int, qe: int, src: int, ks: int, ke: int, dlo: int, dhi: int,
            out: list[Piece]) -> None:
    """Kernel pieces of one tightened rectangle in local coordinates (``d = k - q``)."""
    if dlo == -INF and dhi == INF:
        out.append(Piece(b, qs, qe, src, ks, ke, FULL))
        return
    if dlo == -INF:
        # Row q sees keys up to q + dhi; the top row's last key is k0 = qs + dhi. Keys before
        # k0 are seen by every row; from k0 on it is the top-left causal triangle.
        k0 = qs + dhi
        nk = ke - k0  # <= qe - qs after tightening
        if k0 > ks:
            out.append(Piece(b, qs, qs + nk, src, ks, k0, FULL))
        _causal(b, qs, src, k0, nk, out)
        if qs + nk < qe:  # rows below the square see every key of the box
            out.append(Piece(b, qs + nk, qe, src, ks, ke, FULL))
        return
    step = _band_tile_rows(dlo, dhi)
    for t0 in range(qs, qe, step):
        t1 = min(qe, t0 + step)
        box = _tighten(t0, t1, ks, ke, dlo, dhi)
        if box is None:
            continue
        a, e, c, f, lo, hi = box
        if lo == -INF:
            _pieces(b, a, e, src, c, f, lo, hi, out)
            continue
        # Bounds in piece coordinates: u - r = (k - c) - (q - a) = d - (c - a).
        out.append(Piece(b, a, e, src, c, f, BAND, lo - (c - a),
                         hi - (c - a) if hi < INF else INF))


def merge_full_pieces(pieces: list[Piece]) -> list[Piece]:
    """Fewer, larger kernel calls: FULL pieces of the same query rows whose key rows touch
    become one (softmax does not care in which order keys come), then the same for FULL
    pieces of the same key rows whose query rows touch. Other pieces pass unchanged."""
    full = [p for p in pieces if p.kind == FULL]
    rest = [p for p in pieces if p.kind != FULL]
    for key, lo, hi in ((lambda p: (p.b, p.src, p.q0, p.q1, p.k0), "k0", "k1"),
                        (lambda p: (p.b, p.src, p.k0, p.k1, p.q0), "q0", "q1")):
        full.sort(key=key)
        merged: list[Piece] = []
        for p in full:
            last = merged[-1] if merged else None
            same_rows = last is not None and last.b == p.b and last.src == p.src and (
                (lo == "k0" and (last.q0, last.q1) == (p.q0, p.q1))
                or (lo == "q0" and (last.k0, last.k1) == (p.k0, p.k1)))
            if last is not None and same_rows and getattr(last, hi) == getattr(p, lo):
                fields = {"k1": p.k1} if hi == "k1" else {"q1": p.q1}
                merged[-1] = last._replace(**fields)
            else:
                merged.append(p)
        full = merged
    return rest + full


def to_buffer_coords(pieces: list[Piece], needed: list[tuple[int, int]]) -> list[Piece]:
    """Pieces re-addressed to a receive buffer holding the ``needed`` ranges back to back."""
    starts = [a for a, _ in needed]
    offsets, pos = [], 0
    for a, b in needed:
        offsets.append(pos)
        pos += b - a
    out = []
    for p in pieces:
        i = bisect.bisect_right(starts, p.k0) - 1
        shift = offsets[i] - needed[i][0]
        out.append(Piece(p.b, p.q0, p.q1, p.src, p.k0 + shift, p.k1 + shift, p.kind, p.dlo,
                         p.dhi))
    return out


__all__ = ["FULL", "CAUSAL", "BAND", "PIECE_KINDS", "Run", "Piece", "index_runs",
           "merge_full_pieces", "to_buffer_coords"]
