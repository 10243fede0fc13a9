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
from cp_magi.locality.slicing import Offer, graded_slices, piece_slices
from cp_magi.locality.units import Units


def pack(units: Units, members: np.ndarray, cp: int, t: int, mean: float, cap: float,
         bound: int) -> tuple[Bins, np.ndarray, list[int]]:
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


__all__ = ["pack"]
