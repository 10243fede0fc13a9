"""A floor on the key rows the busiest rank receives: no balanced placement receives less.

The solver ends its search when a placement reaches the floor, and the counted benchmark
reports it beside round_robin's busiest rank: where the floor is above a goal, no layout
with equal shares and balanced work reaches that goal on that row.

Causal unit of ``L`` rows, row ``r`` costing ``r + 1`` pairs, every rank carrying at most
``C`` pairs and ``T`` rows, the busiest receiving ``R``. A rank whose highest row of the
unit is ``q`` receives every row below ``q`` it does not hold, so it holds at least
``q + 1 - R`` of them. Take any row ``p``: the ``K`` ranks holding a row at or above ``p``
hold all ``b = L - p`` of those rows (work ``A``) and at least ``K (p + 1 - R)`` rows in
all, so at least ``m = K (p + 1 - R) - b`` rows below ``p``, which weigh at least the ``m``
lightest rows, ``m (m + 1) / 2``. Their work fits ``K`` ranks only if
``A + m (m + 1) / 2 <= K C``, so ``m <= h(K)`` (the positive root) and, with ``m <= p`` too,

    ``R >= p + 1 - (min(h(K), p) + b) / K``

for the best integer ``K`` in ``[A / C, cp]``; and ``R >= p + 1 - T`` (a rank holds at most ``T``
rows). The floor is the largest of these over a grid of ``p`` (every ``p`` gives a true
bound, the grid only chooses which). ``m`` is taken real (a larger ``h``, so a lower floor,
still a floor). ``(min(h, p) + b) / K`` is a concave function over a linear one in ``K``,
so its largest value at an integer ``K`` is at one of the two integers next to its real
maximiser, which has a closed form (a quadratic's root, clipped). It ignores every other
unit's work (which only adds to the ranks'), so it holds for any placement of the whole stream.

Bidirectional: a unit that fits one rank receives nothing; otherwise each holder receives
``L - n`` with ``n <= min(T, C / L)``, so there are at least ``k = ceil(L / min(T, C / L))``
holders and the one holding least holds at most ``floor(L / k)`` rows. Sliding windows: 0 (no floor beyond the trivial one).
"""

from __future__ import annotations

import numpy as np

from cp_magi.locality.units import Units

#: Rows ``p`` tried per unit (evenly spaced, the unit's last row always among them).
GRID = 256


def causal_floor(length: int, cap: float, ranks: int, t: int, grid: int = GRID) -> int:
    """The floor (module docstring) for one causal unit of ``length`` rows on ``ranks``
    ranks of at most ``cap`` pairs and ``t`` rows each."""
    if length <= 0:
        return 0
    big = float(length)
    p = np.unique(np.linspace(0, length - 1, min(grid, length)).round()).astype(np.float64)
    b = big - p
    work_above = (big * (big + 1) - p * (p + 1)) / 2  # A: rows p .. L-1
    lo = np.maximum(work_above / cap, 1.0)  # fewer ranks cannot carry the rows above p
    if float(np.ceil(lo - 1e-9).max()) > ranks:  # not even every rank carries it
        return length
    # Stationary point of g(K) = (h(K) + b) / K with h(K) = (sqrt(1 + 8 (K C - A)) - 1) / 2:
    # in s = sqrt(1 + 8 (K C - A)), s^2 + (4 b - 2) s + 1 - 8 A = 0.
    lin = 4 * b - 2
    s = (-lin + np.sqrt(np.maximum(lin * lin - 4 * (1 - 8 * work_above), 0.0))) / 2
    k_star = ((s * s - 1) / 8 + work_above) / cap
    # Past the K where h reaches p, g = (p + b) / K only falls: clip there too.
    k_sat = ((2 * p + 1) ** 2 - 1) / 8 / cap + work_above / cap
    # g is quasi-concave in K, so over the integers its maximum is at one of the two next to
    # the real maximiser (clipped to the ranks that can carry A).
    k_lo = np.ceil(lo - 1e-9)
    best = np.clip(np.minimum(k_star, k_sat), k_lo, float(ranks))
    g = np.maximum(_g(np.floor(best).clip(k_lo, ranks), cap, work_above, p, b),
                   _g(np.ceil(best).clip(k_lo, ranks), cap, work_above, p, b))
    need = np.maximum(p + 1 - g, p + 1 - t)
    # The floor of a real bound on an integer count, less a hair for rounding.
    return int(max(0.0, float(np.ceil(need.max() - 1e-6))))


def _g(k: np.ndarray, cap: float, work_above: np.ndarray, p: np.ndarray, b: np.ndarray
       ) -> np.ndarray:
    """``(min(h(K), p) + b) / K``: rows per rank the ranks at or above ``p`` may leave out."""
    h = (np.sqrt(np.maximum(1 + 8 * (k * cap - work_above), 0.0)) - 1) / 2
    return (np.minimum(h, p) + b) / k


def bidirectional_floor(length: int, cap: float, ranks: int, t: int) -> int:
    """The floor for one bidirectional unit (module docstring)."""
    if length <= t and float(length) * length <= cap:
        return 0
    most = min(t, int(cap // max(length, 1)))  # rows one holder may hold
    if most <= 0 or -(-length // most) > ranks:
        return length  # no balanced placement at all
    # At least ceil(L / most) holders, so the one holding least holds at most L over that.
    return length - length // -(-length // most)


def recv_floor(units: Units, cp: int, t: int, cap: float) -> int:
    """The floor on the busiest rank's received rows for ``units`` on ``cp`` ranks of ``t``
    rows, no rank above ``cap`` pairs (module docstring), from the longest unit (causal: any
    placement of a longer unit places its first rows as a shorter one, no rank receiving
    more or carrying more work, so a shorter unit's floor is never the higher one;
    bidirectional: the floor grows with the length)."""
    if units.lengths.size == 0:
        return 0
    longest = int(units.lengths.max())
    if units.model.graded:
        return causal_floor(longest, cap, cp, t)
    if units.model.kind == "bidirectional":
        return bidirectional_floor(longest, cap, cp, t)
    return 0


__all__ = ["causal_floor", "bidirectional_floor", "recv_floor", "GRID"]
