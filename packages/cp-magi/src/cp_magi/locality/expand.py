"""From an anchor's bin to its ranks: the bin's fill dealt out, the slices reshaped to fit.

An anchor's bin holds the fill of all its ranks. The planned slices
(:mod:`cp_magi.locality.anchors`) fix every rank's token count ``h_i`` for the anchor, so
rank ``i`` gets ``T - h_i`` tokens of fill: stones whole where they fit, then the sand
poured exactly, each rank aiming at the fill work its planned slice leaves. What the fill
carries differs a little from that aim, so each slice is then cut again front to back with
its token count kept and its work set to what the rank still needs, which a head of ``a`` and
a tail of ``h_i - a`` rows reach by a linear equation in ``a`` (a tail change moves the next
slice's top, and the last slice, the middle that is left, takes what remains).
"""

from __future__ import annotations

import numpy as np

from cp_magi.locality.bins import Bins, Piece, pour
from cp_magi.locality.slicing import Slice
from cp_magi.locality.stones import place_stones
from cp_magi.locality.units import Part, Units


def _head(x: int, a: int) -> int:
    return a * x + a * (a + 1) // 2


def _tail(y: int, b: int) -> int:
    return b * y - b * (b - 1) // 2


def reshape(length: int, tokens: list[int], goals: list[float]) -> list[tuple[Part, ...]]:
    """Graded slices of a causal unit with the given token counts (summing to ``length``),
    each but the last with work as near its goal as a head-tail cut allows."""
    x, y = 0, length
    out: list[tuple[Part, ...]] = []
    for i, (h, goal) in enumerate(zip(tokens, goals)):
        if i == len(tokens) - 1 or h >= y - x:
            out.append(((x, y),))
            x = y
            continue
        # head(x, a) + tail(y, h - a) = a * (x - y + h) + h * y - h * (h - 1) / 2.
        span = y - x - h
        a = round((h * y - h * (h - 1) / 2 - goal) / span) if span > 0 else h
        a = min(max(a, 0), h)
        b = h - a
        # The non-empty ones of the head and the tail (this runs thousands of times per
        # placement: no generator).
        if a > 0 and b > 0:
            out.append(((x, x + a), (y - b, y)))
        elif a > 0:
            out.append(((x, x + a),))
        else:
            out.append(((y - b, y),) if b > 0 else ())
        x, y = x + a, y - b
    return out


def expand_anchor(units: Units, u: int, slices: list[Slice], fill: dict[int, list[Part]],
                  t: int, mean: float, sand: set[int]) -> list[dict[int, list[Part]]]:
    """Holdings of the ranks of anchor ``u``: slice plus fill each (module docstring)."""
    k = len(slices)
    model = units.model
    n = int(units.lengths[u])
    slots = Bins.empty(np.asarray([t - s.tokens for s in slices], np.int64),
                       np.asarray([mean - s.work for s in slices], np.float64))
    stones = [v for v, parts in fill.items() if v not in sand and v >= 0
              and parts == [(0, int(units.lengths[v]))]]
    pieces: list[Piece] = [(v, lo, hi) for v, parts in fill.items() if v not in stones
                           for lo, hi in parts]
    left = place_stones(slots, units, np.asarray(stones, np.int64), 0.0)
    pieces += [(v, 0, int(units.lengths[v])) for v in left]
    pour(slots, units, pieces)
    if model.graded:
        goals = [mean - float(slots.work[i]) for i in range(k)]
        shapes = reshape(n, [s.tokens for s in slices], goals)
    else:
        shapes = [s.parts for s in slices]
    out = []
    for i in range(k):
        held = {v: list(p) for v, p in slots.parts[i].items()}
        held[u] = list(shapes[i])
        out.append(held)
    return out


__all__ = ["reshape", "expand_anchor"]
