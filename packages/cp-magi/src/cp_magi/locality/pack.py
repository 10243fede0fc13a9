"""Packing the units that are not sand onto the ranks: whole where they fit, sliced if not.

Units go in by decreasing work (the longest-processing-time rule). A rank's *load* is its
work plus what the material not yet placed (this unit aside) would add at its average work
per token ``rho`` to fill the rank's remaining slots; no load may pass ``cap``. A unit that fits whole on some
rank goes to the least loaded one; otherwise it is sliced (:mod:`cp_magi.locality.slicing`)
over the ranks that receive least so far (the least loaded first among equals), each slice
within its rank's load and within the bound on received rows. A unit that cannot fit is left
to the sand.
"""

from __future__ import annotations

import numpy as np

from cp_magi.locality.bins import Bins
from cp_magi.locality.slicing import Offer, Slice, graded_slices, piece_slices
from cp_magi.locality.units import Units


def even_slices(model, unit: int, length: int, k: int) -> list[Slice]:
    """``k`` slices of equal work: head-tail pairs of ``2k`` equal chunks for a causal unit
    (TransformerEngine's split), equal contiguous pieces otherwise."""
    if model.graded and k > 1:
        edges = [length * i // (2 * k) for i in range(2 * k + 1)]
        out = []
        for i in range(k):
            parts = tuple(p for p in ((edges[i], edges[i + 1]),
                                      (edges[2 * k - 1 - i], edges[2 * k - i])) if p[1] > p[0])
            if i == k - 1:
                parts = ((edges[i], edges[2 * k - i]),)
            out.append(Slice(unit, parts, sum(b - a for a, b in parts),
                             sum(model.work(length, a, b) for a, b in parts),
                             model.recv(length, list(parts))))
        return out
    edges = [length * i // k for i in range(k + 1)]
    return [Slice(unit, ((a, b),), b - a, model.work(length, a, b), model.recv(length, [(a, b)]))
            for a, b in zip(edges[:-1], edges[1:])]


def pack(units: Units, members: np.ndarray, cp: int, t: int, mean: float, cap: float,
         bound: int | None) -> tuple[Bins, np.ndarray, list[int]]:
    """``(ranks as bins, received rows, units left)`` (module docstring)."""
    ranks = Bins.empty(np.full(cp, t, np.int64), np.full(cp, mean, np.float64))
    recv = np.zeros(cp, np.int64)
    model = units.model
    left_work = float(units.total_work)
    left_tokens = float(cp * t)
    left: list[int] = []
    for u in members[np.lexsort((members, -units.work[members]))].tolist():
        n, w = int(units.lengths[u]), int(units.work[u])
        # What fills the rest of a rank is everything still unplaced but this unit.
        rho = (left_work - w) / max(left_tokens - n, 1.0)
        load = ranks.work + rho * (t - ranks.tokens)
        fits = (ranks.tokens + n <= t) & (load + w - rho * n <= cap)
        if fits.any():
            r = int(np.argmin(np.where(fits, load, np.inf)))
            ranks.add(r, u, 0, n, w)
        elif bound is None:
            got = _even(model, ranks, u, n, w, t, rho, load, cap, recv)
            if got is None:
                left.append(u)
                continue
            for r, s in got:
                for a, b in s.parts:
                    ranks.add(r, u, a, b, 0)
                ranks.work[r] += s.work
                recv[r] += s.recv
        else:
            open_ = np.nonzero((ranks.tokens < t) & (recv < bound) & (load < cap))[0]
            ranked = open_[np.lexsort((open_, load[open_], recv[open_]))]
            offers = [Offer(int(r), int(t - ranks.tokens[r]), float(cap - load[r]), rho,
                            int(bound - recv[r])) for r in ranked.tolist()]
            got = (graded_slices(u, n, offers) if model.graded
                   else piece_slices(model, u, n, offers)) if offers else None
            if got is None:
                left.append(u)
                continue
            for r, s in got:
                for a, b in s.parts:
                    ranks.add(r, u, a, b, 0)
                ranks.work[r] += s.work
                recv[r] += s.recv
        left_work -= w
        left_tokens -= n
    return ranks, recv, left


def _even(model, ranks: Bins, u: int, n: int, w: int, t: int, rho: float, load: np.ndarray,
          cap: float, recv: np.ndarray) -> list[tuple[int, Slice]] | None:
    """Even slices over the fewest least-loaded ranks that hold them within ``cap``."""
    order = np.lexsort((np.arange(load.size), recv, load))
    for k in range(2, load.size + 1):
        slices = even_slices(model, u, n, k)
        chosen = order[:k]
        # The slices that receive most go to the ranks that receive least.
        chosen = chosen[np.argsort(recv[chosen], kind="stable")]
        sl = sorted(slices, key=lambda s: -s.recv)
        ok = all(ranks.tokens[r] + s.tokens <= t and load[r] + s.work - rho * s.tokens <= cap
                 for r, s in zip(chosen.tolist(), sl))
        if ok:
            return list(zip(chosen.tolist(), sl))
    return None


__all__ = ["pack", "even_slices"]
