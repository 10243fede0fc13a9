"""The locality placement: long units sliced over few ranks, everything else whole, balanced.

:func:`solve` minimises the key rows the busiest rank receives subject to attention work
max/mean <= ``1 + tolerance`` and exactly ``T`` tokens per rank:

1. the shortest units and the free slots are *sand* (about ``sand`` of the tokens), the rest
   are packed by decreasing work (:mod:`cp_magi.locality.pack`): whole where they fit,
   sliced where they must, no slice's rank above a bound ``R`` on received rows;
2. the smallest ``R`` that packs is found by bisection (below the first bound of a coarse
   grid that packs: a looser bound can pack worse, so feasibility is not monotone);
3. sand fills every rank to exactly ``T`` tokens with work on the mean
   (:mod:`cp_magi.locality.fill`);
4. when the work comes out above the tolerance, the next of :data:`ATTEMPTS` (less headroom
   for the packed units, more sand) is tried; the first balanced placement is kept (the most
   balanced one when none is).

Pure host code on integers, deterministic (stable sorts, index tie-breaks, no time limits):
every rank solves alone and reaches the same placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_core.backend_api import RankRuns
from cp_magi.locality.fill import FREE, Ranks, pour_sand
from cp_magi.locality.level import level
from cp_magi.locality.pack import pack
from cp_magi.locality.units import Units

#: (share of the tolerance the packed units may use, sand fraction), tried in order.
ATTEMPTS: tuple[tuple[float, float, float], ...] = (
    (0.5, 0.15, 1.0), (0.5, 0.15, 0.25), (0.5, 0.3, 1.0), (0.5, 0.3, 0.25), (0.0, 0.3, 1.0),
    (-1.0, 0.5, 1.0),
)
#: Coarse grid of bounds (fractions of the longest unit) scanned before the bisection.
GRID = 16


@dataclass(frozen=True)
class Placement:
    """One solved placement.

    Attributes:
        runs: every rank's stream runs (ascending).
        work: ``[cp]`` attention work of every rank (the kind model's count).
        recv: ``[cp]`` key rows every rank receives (the kind model's count).
        split_units: units not held whole by one rank.
        bound: the packed slices' bound on received rows (0 when nothing was sliced).
        tokens_per_rank: ``T``.
    """

    runs: RankRuns
    work: np.ndarray
    recv: np.ndarray
    split_units: int
    bound: int
    tokens_per_rank: int

    @property
    def balance(self) -> float:
        """Work max/mean over the ranks (1.0 when there is no work)."""
        mean = float(self.work.mean()) if self.work.size else 0.0
        return float(self.work.max()) / mean if mean > 0 else 1.0


def _runs(ranks: Ranks, units: Units) -> RankRuns:
    starts, lengths = [], []
    for held in ranks.parts:
        runs = []
        for u, parts in held.items():
            base = 0 if u == FREE else int(units.starts[u])
            runs += [(base + a, b - a) for a, b in parts]
        runs.sort()
        starts.append(np.asarray([s for s, _ in runs], np.int64))
        lengths.append(np.asarray([n for _, n in runs], np.int64))
    return RankRuns.build(starts, lengths)


def split_sand(units: Units, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(sand, packed)`` unit ids: the shortest units up to ``fraction`` of all tokens
    (counting the free slots as sand first)."""
    order = np.lexsort((np.arange(units.lengths.size), units.lengths))
    free = int((units.free[:, 1] - units.free[:, 0]).sum()) if units.free.size else 0
    want = fraction * units.stream_len - free
    n = 0
    if want > 0 and order.size:
        n = min(order.size, int(np.searchsorted(np.cumsum(units.lengths[order]), want)) + 1)
    return np.sort(order[:n]), np.sort(order[n:])


def solve(units: Units, cp: int, tolerance: float = 0.01) -> Placement:
    """The placement of ``units`` on ``cp`` ranks (module docstring)."""
    if units.stream_len % cp:
        raise ValueError(f"stream of {units.stream_len} slots does not split over cp={cp}")
    t = units.stream_len // cp
    mean = units.total_work / cp
    best = None
    for share, fraction, lighter in ATTEMPTS:
        sand, members = split_sand(units, fraction)
        sand_tokens = int(units.lengths[sand].sum()) + int(
            (units.free[:, 1] - units.free[:, 0]).sum() if units.free.size else 0)
        rho = float(units.work[sand].sum()) / sand_tokens if sand_tokens else 0.0
        top = int(units.lengths[members].max()) if members.size else 0
        balanced_here = False
        for bound in sorted({top * i // GRID for i in range(GRID + 1)}):
            ranks, _, left = pack(units, members, cp, t, mean * (1 + share * tolerance), rho,
                                  bound, rho * lighter)
            poured = np.concatenate([sand, np.asarray(left, np.int64)])
            pour_sand(ranks, units, poured, t, mean)
            level(ranks, units, poured, t, mean * (1 + tolerance / 2))
            worst = float(ranks.work.max()) / mean if mean > 0 else 1.0
            balanced = worst <= 1.0 + tolerance
            key = (not balanced, float(ranks.recv(units).max()) if balanced else worst)
            if best is None or key < best[0]:
                best = (key, ranks, bound)
            balanced_here |= balanced
        if balanced_here:
            break
    if best is None:
        raise RuntimeError("no packing found")  # unreachable: the loosest bound always packs
    _, ranks, bound = best
    split = sum(1 for u in range(units.lengths.size)
                if sum(u in held for held in ranks.parts) > 1)
    return Placement(_runs(ranks, units), ranks.work.copy(), ranks.recv(units), split, bound, t)


__all__ = ["Placement", "solve", "split_sand", "ATTEMPTS"]
