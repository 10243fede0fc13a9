"""Packing the units that are not sand: whole where they fit, sliced where they must.

A rank's *load* is its work plus what sand (work per token ``rho``) would add to fill its
remaining slots; no load may pass ``cap``. *Stones*, the units that fit whole on an empty
rank, go first, by decreasing work, each to the fullest rank it still fits on (best fit), so
that whole ranks stay free. The other units, longer than a rank or heavier than it can
carry, go last by decreasing work, sliced (:mod:`cp_magi.locality.slicing`) over the emptiest
ranks, each slice within the rank's remaining load and within the bound on received rows:
slices can be cut to any size, so they fill the room the stones left. A unit with no way to
fit is left to the sand.
"""

from __future__ import annotations

import numpy as np

from cp_magi.locality.fill import Ranks
from cp_magi.locality.slicing import Offer, Slice, graded_slices, piece_slices
from cp_magi.locality.units import Units


def pack(units: Units, members: np.ndarray, cp: int, t: int, cap: float, rho: float,
         bound: int, rho_slices: float | None = None
         ) -> tuple[Ranks, np.ndarray, list[int]]:
    """``(ranks, recv, left)`` after packing ``members`` (module docstring); ``left``: the
    units that fit nowhere, whole or sliced, within the bound (the sand takes them).
    ``rho_slices``: the sand density slices are budgeted with (default ``rho``)."""
    rs = rho if rho_slices is None else rho_slices
    ranks = Ranks.empty(cp)
    recv = np.zeros(cp, np.int64)
    model = units.model
    order = members[np.lexsort((members, -units.work[members]))]
    whole = (units.lengths[order] <= t) & \
        (units.work[order] - rho * units.lengths[order] <= cap - rho * t)
    stones, anchors = order[whole], order[~whole]
    left: list[int] = []
    # Stones first, best fit: the fullest rank they still fit on, so that whole ranks stay
    # free for the slices of the long units.
    for u in stones.tolist():
        n, w = int(units.lengths[u]), int(units.work[u])
        load = ranks.work + rho * (t - ranks.tokens)
        fits = (ranks.tokens + n <= t) & (load + w - rho * n <= cap)
        if not fits.any():
            anchors = np.append(anchors, u)
            continue
        r = int(np.argmax(np.where(fits, load, -np.inf)))
        ranks.add(r, u, 0, n, w)
    for u in anchors.tolist():
        n = int(units.lengths[u])
        load = ranks.work + rs * (t - ranks.tokens)
        open_ = np.nonzero((ranks.tokens < t) & (recv < bound) & (load < cap))[0]
        if open_.size == 0:
            left.append(u)
            continue
        # The emptiest ranks first (their slices can be whole budgets), then the least
        # receiving.
        ranked = open_[np.lexsort((open_, recv[open_], load[open_]))]
        offers = [Offer(int(r), int(t - ranks.tokens[r]), float(cap - load[r]), rs,
                        int(bound - recv[r])) for r in ranked.tolist()]
        got = (graded_slices(u, n, offers) if model.graded
               else piece_slices(model, u, n, offers))
        if got is None:
            left.append(u)
            continue
        for r, s in got:
            _place(ranks, r, s)
            recv[r] += s.recv
    return ranks, recv, left


def _place(ranks: Ranks, r: int, s: Slice) -> None:
    for a, b in s.parts:
        ranks.add(r, s.unit, a, b, 0)
    ranks.work[r] += s.work


__all__ = ["pack"]
