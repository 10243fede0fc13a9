"""Every rank's holdings, and the sand that fills each rank to exactly ``T`` tokens.

*Sand* is the free slots (pad: no work, no keys) and the shortest units. After the other
units are packed (:mod:`cp_magi.locality.pack`), sand fills every rank to exactly ``T``
tokens: sorted by work per token, each rank takes some tokens from the dense end and the rest
from the light end so that its work lands on the mean (bisection over the split), the ranks
furthest from the sand's own density first. A sand unit is cut wherever a rank's share ends;
its next holder receives the rows before its part, few for a short unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cp_magi.locality.units import Part, Units

#: Unit id of free slots (pad) in a rank's holdings: they carry no work and need no keys.
FREE = -1


@dataclass
class Ranks:
    """What every rank holds so far: parts per unit (relative ranges; ``FREE`` holds absolute
    stream ranges), tokens and work."""

    cp: int
    tokens: np.ndarray
    work: np.ndarray
    parts: list[dict[int, list[Part]]] = field(default_factory=list)

    @classmethod
    def empty(cls, cp: int) -> "Ranks":
        """``cp`` empty ranks."""
        return cls(cp, np.zeros(cp, np.int64), np.zeros(cp, np.int64),
                   [dict() for _ in range(cp)])

    def add(self, r: int, unit: int, a: int, b: int, work: int) -> None:
        """Give rank ``r`` rows ``[a, b)`` of ``unit`` (absolute slots for ``FREE``)."""
        if b <= a:
            return
        self.parts[r].setdefault(unit, []).append((a, b))
        self.tokens[r] += b - a
        self.work[r] += work

    def recv(self, units: Units) -> np.ndarray:
        """Key rows every rank receives under the units' kind model."""
        out = np.zeros(self.cp, np.int64)
        for r, held in enumerate(self.parts):
            out[r] = sum(units.model.recv(int(units.lengths[u]), p)
                         for u, p in held.items() if u != FREE)
        return out


def _work_of(units: Units, u: int, a: int, b: int) -> int:
    return 0 if u == FREE else units.model.work(int(units.lengths[u]), a, b)


def _cost(units: Units, u: int, a: int, b: int) -> int:
    """Key rows the holder of rows ``[a, b)`` of ``u`` receives for them alone."""
    return 0 if u == FREE else units.model.recv(int(units.lengths[u]), [(a, b)])


def pour_sand(ranks: Ranks, units: Units, sand: np.ndarray, t: int, mean_work: float) -> None:
    """Sand and free slots to every rank, exactly ``t`` tokens, work towards ``mean_work``:
    sorted dense first, each rank takes from both ends (module docstring)."""
    items = [[int(u), 0, int(units.lengths[u])] for u in sand.tolist()]
    items += [[FREE, int(a), int(b)] for a, b in units.free.tolist()]
    items.sort(key=lambda it: (-_work_of(units, *it) / (it[2] - it[1]), it[0], it[1]))
    total = sum(b - a for _, a, b in items)
    rho = sum(_work_of(units, *it) for it in items) / max(total, 1)
    need = t - ranks.tokens
    dens = (mean_work - ranks.work) / np.maximum(need, 1)
    order = sorted((r for r in range(ranks.cp) if need[r] > 0),
                   key=lambda r: (-abs(dens[r] - rho), r))
    for r in order:
        tau = int(t - ranks.tokens[r])
        goal = mean_work - ranks.work[r]
        d = _split_point(units, items, tau, goal)
        for u, a, b in _take(items, d, True) + _take(items, tau - d, False):
            ranks.add(r, u, a, b, _work_of(units, u, a, b))


def _peek(units: Units, items: list[list[int]], n: int, dense: bool) -> int:
    total = 0
    for u, a, b in (items if dense else reversed(items)):
        if n <= 0:
            break
        k = min(n, b - a)
        total += _work_of(units, u, a, a + k)
        n -= k
    return total


def _take(items: list[list[int]], n: int, dense: bool) -> list[tuple[int, int, int]]:
    """Remove ``n`` tokens from one end (a cut item keeps its rest in place)."""
    out = []
    while n > 0 and items:
        it = items[0] if dense else items[-1]
        u, a, b = it
        k = min(n, b - a)
        out.append((u, a, a + k))
        n -= k
        if a + k == b:
            items.pop(0 if dense else -1)
        else:
            it[1] = a + k
    return out


def _split_point(units: Units, items: list[list[int]], tau: int, goal: float) -> int:
    """Tokens to take from the dense end (the rest from the light end) for work ``goal``."""

    def work(d: int) -> int:
        return _peek(units, items, d, True) + _peek(units, items, tau - d, False)

    lo, hi = 0, tau
    if work(hi) <= goal:
        return hi
    if work(lo) >= goal:
        return lo
    while hi - lo > 1:
        m = (lo + hi) // 2
        if work(m) <= goal:
            lo = m
        else:
            hi = m
    return lo if abs(work(lo) - goal) <= abs(work(hi) - goal) else hi


__all__ = ["FREE", "Ranks", "pour_sand"]
