"""The two-ended sweep: every rank takes a run of the densest and a run of the lightest rows.

All rows of the stream are laid on one line, units by decreasing work per token (the free
slots, which carry no work, last), each unit's rows *outside in* (``0, L-1, 1, L-2, ...``):
any run of a unit's rows on the line is a head and a tail of it (or a middle), so a piece of
a causal unit carries about the unit's mean density and its holder receives only the rows
between its head and its tail. Rank ``r`` then takes the next ``d_r`` rows from the dense end
and the next ``T - d_r`` from the light end, with ``d_r`` the count whose work is nearest
what the ranks still need per rank (the work grows with ``d_r``: a bisection over
cumulative sums). Since what is left always has the mean density, the lightest ``T`` rows
carry at most and the densest ``T`` at least the mean, so every rank lands within one row's
work of its goal.

A unit is cut only where a rank's run ends: at most two cuts per rank, whole units
everywhere else. Long units sit at the dense end and are shared by consecutive ranks, each
holding a head and a tail of them; short units at the light end stay whole. One pass over
the units (numpy) and ``cp`` bisections: no search. The cut units are then cut again into
nested rings (:func:`rings`) and, under causal kinds, so that their busiest holders receive
less (:mod:`cp_magi.locality.heavy`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

from cp_magi.locality.bins import FREE
from cp_magi.locality.counts import Holding, _merged
from cp_magi.locality.heavy import MORE_PASSES, outer_heavy
from cp_magi.locality.ring_order import ring_orders
from cp_magi.locality.units import Units


class Line:
    """The units on one line (module docstring) with cumulative tokens and work."""

    def __init__(self, units: Units) -> None:
        self.units = units
        n = units.lengths.size
        free = units.free
        lengths = np.concatenate([units.lengths, free[:, 1] - free[:, 0]]).astype(np.int64)
        work = np.concatenate([units.work, np.zeros(len(free), np.int64)]).astype(np.int64)
        ids = np.concatenate([np.arange(n), -1 - np.arange(len(free))]).astype(np.int64)
        keep = lengths > 0
        lengths, work, ids = lengths[keep], work[keep], ids[keep]
        density = work / np.maximum(lengths, 1)
        order = np.lexsort((np.arange(ids.size), -density))
        self.ids = ids[order]
        self.lengths = lengths[order]
        self.work = work[order]
        self.ct = np.concatenate(([0], np.cumsum(self.lengths)))
        self.cw = np.concatenate(([0], np.cumsum(self.work)))
        # Plain lists for the scalar look-ups of the bisections (numpy's per-call cost is
        # most of a look-up's time).
        self._ct, self._cw = self.ct.tolist(), self.cw.tolist()
        self._ids, self._len, self._work = (self.ids.tolist(), self.lengths.tolist(),
                                            self.work.tolist())
        self._causal = units.model.graded

    @property
    def tokens(self) -> int:
        """Rows on the line."""
        return int(self.ct[-1])

    def _prefix(self, i: int, n: int) -> int:
        """Work of the first ``n`` rows (outside in) of the ``i``-th unit on the line."""
        u = self._ids[i]
        if u < 0 or n <= 0:
            return 0
        length = self._len[i]
        if n >= length:
            return self._work[i]
        heads, tails = (n + 1) // 2, n // 2
        if self._causal:  # the causal count inline: this runs hundreds of times a sweep
            rest = length - tails
            return (heads * (heads + 1) + length * (length + 1) - rest * (rest + 1)) // 2
        model = self.units.model
        return model.work(length, 0, heads) + model.work(length, length - tails, length)

    def upto(self, x: int) -> int:
        """Work of the first ``x`` rows of the line."""
        ct = self._ct
        if x <= 0:
            return 0
        if x >= ct[-1]:
            return self._cw[-1]
        i = bisect_right(ct, x) - 1
        n = x - ct[i]  # 0 <= n < the unit's length
        if n == 0 or self._ids[i] < 0:
            return self._cw[i]
        if self._causal:  # _prefix's causal count inline: the bisections call this most
            length = self._len[i]
            heads, rest = (n + 1) // 2, length - n // 2
            return self._cw[i] + (heads * (heads + 1) + length * (length + 1)
                                  - rest * (rest + 1)) // 2
        return self._cw[i] + self._prefix(i, n)

    def parts(self, x: int, y: int) -> list[tuple[int, int, int]]:
        """``(unit or FREE, lo, hi)`` pieces of line rows ``[x, y)``: unit rows relative to
        the unit (a head and a tail that touch as one piece), free slots as stream ranges."""
        out: list[tuple[int, int, int]] = []
        if y <= x:
            return out
        ct = self._ct  # plain lists: numpy's per-call cost is most of this loop's time
        i0 = bisect_right(ct, x) - 1
        i1 = bisect_left(ct, y)
        for i in range(i0, i1):
            c0 = ct[i]
            s, e = max(x, c0) - c0, min(y, ct[i + 1]) - c0
            u, length = self._ids[i], self._len[i]
            if u < 0:
                a = int(self.units.free[-1 - u, 0])
                out.append((FREE, a + s, a + e))
                continue
            # Heads: even line places q -> row q/2; tails: odd q -> row L-1-(q-1)/2.
            h0, h1 = (s + 1) // 2, (e + 1) // 2
            t0, t1 = s // 2, e // 2
            if h1 > h0 and t1 > t0 and h1 == length - t1:  # they touch: one piece
                out.append((u, h0, length - t0))
                continue
            if h1 > h0:
                out.append((u, h0, h1))
            if t1 > t0:
                out.append((u, length - t1, length - t0))
        return out


def sweep(units: Units, cp: int, t: int, slack: float = 0.005) -> list[Holding]:
    """Every rank's holdings by the two-ended sweep (module docstring). A rank's work may be
    off its goal by ``slack`` of it where that lets one of its runs end on a unit's edge
    (a unit not cut there receives nothing for it)."""
    line = Line(units)
    if line.tokens != cp * t:
        raise ValueError("the line does not hold cp * T rows")
    lo_end, hi_end = 0, line.tokens
    left_work = float(line.cw[-1])
    out: list[Holding] = []
    for r in range(cp):
        if r == cp - 1:
            d = hi_end - lo_end
        else:
            d, got = _count(line, lo_end, hi_end, t, left_work / (cp - r), slack)
            left_work -= got
        held: Holding = {}
        for u, a, b in line.parts(lo_end, lo_end + d) + line.parts(hi_end - (t - d), hi_end):
            held.setdefault(u, []).append((a, b))
        lo_end, hi_end = lo_end + d, hi_end - (t - d)
        for u, parts in held.items():
            if len(parts) > 1:  # one part is merged already (most units: no sort per unit)
                held[u] = _merged(parts)
        out.append(held)
    if units.model.kind == "sliding_window":
        return out  # a ring's work per row depends on its depth there: the cuts stay
    out = rings(units, out)
    if not units.model.graded:
        return out
    mean = float(line.cw[-1]) / cp
    return outer_heavy(units, out, mean * (1 + 2 * slack), front=True, more_passes=MORE_PASSES)


def _count(line: Line, lo_end: int, hi_end: int, t: int, goal: float, slack: float
           ) -> tuple[int, int]:
    """Rows ``d`` one rank takes from the dense end (the rest of ``t`` from the light end):
    the count nearest ``goal``, or, within ``slack`` of it, one that ends a run on a unit's
    edge (the cheaper cut); with the work of those rows, as ``(d, work)``."""
    upto = line.upto
    base = upto(hi_end) - upto(lo_end)
    seen: dict[int, int] = {}  # counts are looked at again (the ends, the candidates)

    def work(d: int) -> int:
        got = seen.get(d)
        if got is None:
            got = seen[d] = upto(lo_end + d) + base - upto(hi_end - (t - d))
        return got

    lo, hi = 0, t
    if work(hi) <= goal:
        lo = hi
    elif work(lo) < goal:
        while hi - lo > 1:
            m = (lo + hi) // 2
            if work(m) <= goal:
                lo = m
            else:
                hi = m
        lo = min((lo, hi), key=lambda x: abs(work(x) - goal))
    best = lo
    # Edges near the two ends of the runs: the unit edges before and after each.
    cands = {best}
    ct = line._ct  # the plain list: numpy's per-call cost
    for x, sign in ((lo_end + best, 1), (hi_end - (t - best), -1)):
        i = bisect_right(ct, x) - 1
        for edge in ct[max(i - 1, 0):i + 3]:
            d = edge - lo_end if sign > 0 else t - (hi_end - edge)
            if 0 <= d <= t and lo_end + d <= hi_end - (t - d):
                cands.add(int(d))
    ok = [d for d in cands if abs(work(d) - goal) <= slack * goal]
    if not ok:
        return best, work(best)
    d = min(ok, key=lambda d: (_cut_cost(line, lo_end + d) + _cut_cost(line, hi_end - (t - d)),
                               abs(work(d) - goal), d))
    return d, work(d)


def _cut_cost(line: Line, x: int) -> int:
    """Rows the cut at line place ``x`` costs at least (the smaller side of the unit)."""
    i = bisect_right(line._ct, x) - 1  # plain lists: numpy's per-call cost
    if i >= len(line._ids) or line._ct[i] == x or line._ids[i] < 0:
        return 0
    s = x - line._ct[i]
    return min(s, line._len[i] - s)


def rings(units: Units, holdings: list[Holding]) -> list[Holding]:
    """Every unit held by several ranks cut again into nested rings, with every rank's row
    count kept. A ring is a head and a tail of the same size (within a row), so its work per
    row is the unit's (causal: exactly ``(L + 1) / 2``) wherever it lies and the balance
    stays; what moves is who receives: the holder of the ring at depth ``x`` receives
    ``L - x - own``. Which holder takes which depth: :mod:`cp_magi.locality.ring_order` (the
    outermost to the holder with most rows, then exchanges that lower the busiest)."""
    holders: dict[int, list[int]] = {}
    for r, held in enumerate(holdings):
        for u in held:
            if u != FREE:
                holders.setdefault(u, []).append(r)
    out = [dict(h) for h in holdings]
    # Rows per holder, for the units held by several ranks only (a few of many).
    own = {u: {r: sum(b - a for a, b in holdings[r][u]) for r in rs}
           for u, rs in holders.items() if len(rs) > 1}
    lengths = {u: int(units.lengths[u]) for u in own}
    for u, ranked in ring_orders(lengths, own, len(holdings)).items():
        front, back = 0, lengths[u]
        for i, r in enumerate(ranked):
            if i == len(ranked) - 1:
                heads, tails = back - front, 0
            else:
                heads, tails = (own[u][r] + 1) // 2, own[u][r] // 2
            parts = [p for p in ((front, front + heads), (back - tails, back)) if p[1] > p[0]]
            out[r][u] = _merged(parts)
            front, back = front + heads, back - tails
    return out


__all__ = ["Line", "sweep", "rings"]
